"""Tensor parallelism (``--tp``, ``--nnodes``) on the CPU over gloo: greedy tokens identical to one rank in
float32 -- through Engine and through the server, on one machine and as two "nodes" on this one -- for models that
split their KV heads, replicate them (tp > KV heads), pad their vocabulary and carry row-parallel biases; a rank
that dies ends every node within seconds; a tp that cannot split the model is refused before anything starts."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import get_body, post_json, save_random
from radixserve import Engine
from radixserve.server_process import ServerProcess

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SYSTEM = "You are a careful assistant. Answer in one short sentence. "
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a color.", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def biased_model(tmp_path_factory, smollm2_path):
    """Llama with q/k/v/o and MLP biases (row-parallel biases are added once, not once per rank) and a vocabulary
    one row larger than the tokenizer's, so no tp divides it (the last vocabulary shard is padded)."""
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    cfg = LlamaConfig(vocab_size=len(tok) + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                      max_position_embeddings=2048, initializer_range=0.25, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return save_random(cfg, tok, tmp_path_factory.mktemp("biased") / "llama-biased", seed=2)


def _needs(tp: int) -> None:
    """On a CUDA machine (benchmarks/gpu_check.sh) each rank takes a GPU of its own: skip what it cannot seat."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip(f"--tp {tp} on CUDA needs {tp} GPUs; this machine has {torch.cuda.device_count()}")


def _greedy(path, tp: int, **kw) -> list[list[int]]:
    """Each prompt's greedy tokens, twice over (the second round hits the radix cache), on ``tp`` ranks."""
    _needs(tp)
    with Engine(str(path), dtype="float32", tp=tp, max_total_tokens=4096, **kw) as engine:
        first = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]
        again = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]
    return first + again


@pytest.mark.parametrize("model, tp, kw", [
    ("llama", 2, {"chunked_prefill_size": 16}),  # KV heads split 2 / 2, prompts prefilled in chunks
    ("llama", 4, {"disable_radix_cache": True}),  # 4 ranks over 2 KV heads: each KV head on two ranks
    ("qwen2", 2, {}),  # one KV head, copied to both ranks; q/k/v biases; tied embeddings
    ("biased", 2, {}),  # o/down biases, a vocabulary no tp divides
    ("phi3", 2, {"chunked_prefill_size": 16}),  # fused qkv_proj / gate_up_proj cut per rank, sliding windows
    ("gemma3", 2, {}),  # q/k norms on every rank, one KV head copied, Gemma norms, two RoPE tables
    ("gemma2", 2, {}),  # soft-capped scores and logits (each rank's vocabulary shard capped)
])
def test_engine_greedy_tokens_equal_one_rank(model, tp, kw, tiny_models, biased_model, arch_models):
    path = biased_model if model == "biased" else arch_models[model] if model in arch_models else tiny_models[model]
    assert _greedy(path, tp, **kw) == _greedy(path, 1, **kw)


def test_a_tp_that_cannot_split_the_model_is_refused(tiny_models, smollm2_path):
    with pytest.raises(ValueError, match=r"--tp 2 cannot split .*9 attention heads.*tp values that fit: 1, 3"):
        Engine(dtype="float32", tp=2)  # SmolLM2: 9 heads, 3 KV heads, MLP 1536
    with pytest.raises(ValueError, match=r"--tp 3 cannot split .*4 attention heads"):
        Engine(str(tiny_models["llama"]), tp=3)
    with pytest.raises(ValueError, match="--dist-init-addr"):
        Engine(str(tiny_models["llama"]), tp=2, nnodes=2)
    with pytest.raises(ValueError, match="spread evenly"):
        Engine(str(tiny_models["llama"]), tp=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="--decode-kernel native .* --tp > 1"):
        Engine(str(tiny_models["llama"]), tp=2, decode_kernel="native")




def _generate(url: str) -> list[list[int]]:
    return [post_json(url + "/generate", {"text": p, "sampling_params": GREEDY})["output_ids"] for p in PROMPTS]


def _ends(proc: subprocess.Popen, within_s: float) -> int:
    proc.wait(within_s)
    return proc.returncode


def test_smollm2_over_three_ranks_serves_what_one_rank_computes(smollm2_path):
    """SmolLM2 (9 heads / 3 KV heads) at --tp 3, float32, through the server: the same greedy tokens as one rank;
    /get_server_info lists the ranks, /health and /metrics count them; killing a rank ends the server."""
    _needs(3)
    with Engine(dtype="float32", max_total_tokens=4096) as engine:
        expected = [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]
    with Engine(dtype="float32", max_total_tokens=4096, tp=3) as engine:  # the same, through Engine
        assert [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)] == expected
    server = ServerProcess("--tp", "3", "--dtype", "float32", "--max-total-tokens", "4096")
    try:
        assert _generate(server.url) == expected
        info = get_body(server.url + "/get_server_info")
        ranks = info["ranks"]["0"]
        assert [r["rank"] for r in ranks] == [0, 1, 2] and all(r["kv_heads"] == 1 for r in ranks)
        assert info["actors"]["runner"]["decode_kernel"] == "eager"
        assert get_body(server.url + "/health") == {"status": "ok", "tp_ranks": 3}
        assert 'radixserve_tp_ranks{node="0"} 3.0' in get_body(server.url + "/metrics")
        os.kill(ranks[2]["pid"], signal.SIGKILL)
        assert _ends(server.proc, 20) != 0
        assert "the runner2 actor exited" in server.output()
    finally:
        server.stop()


def _free_port_run(n: int = 3) -> int:
    """A port p with p .. p + n - 1 free (the store, the plans, the node link)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n >= 65535:
            continue
        try:
            for q in range(port, port + n):
                with socket.socket() as s:
                    s.bind(("", q))  # node 0 listens on every interface
            return port
        except OSError:
            continue
    raise RuntimeError("no free run of ports")


def _listening(ports: set[int]) -> set[tuple[int, str]]:
    """(port, address) of every listening TCP socket on one of ``ports`` (/proc/net/tcp, tcp6)."""
    found = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in open(f"/proc/net/{name}").read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.split(":")
            if state == "0A" and int(port, 16) in ports:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                text = socket.inet_ntop(socket.AF_INET, raw[::-1]) if width == 8 else raw.hex()
                found.add((int(port, 16), text))
    return found


def _rogues_on(port: int) -> None:
    """Strangers on node 0's plans (PORT+1) and nodes' link (PORT+2): subscribe without the key, send garbage, a
    forged NodeDown; garbage to torch's store (PORT); a second or so for their handshakes to fail."""
    import zmq

    from radixserve.wire.codec import encoder
    from radixserve.wire.messages import NodeDown

    ctx = zmq.Context()
    socks = []
    for offset, kind in ((1, zmq.SUB), (2, zmq.DEALER)):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        else:
            sock.setsockopt(zmq.IDENTITY, b"node1")
        sock.connect(f"tcp://127.0.0.1:{port + offset}")
        if kind == zmq.DEALER:
            sock.send(encoder().encode(NodeDown(1, "forged")))
        socks.append(sock)
        with socket.create_connection(("127.0.0.1", port + offset)) as raw:
            raw.sendall(b"\x00garbage" * 64)
    with socket.create_connection(("127.0.0.1", port)) as raw:  # torch's store drops what it cannot parse
        raw.sendall(b"\x00garbage" * 64)
    time.sleep(1.0)
    assert all(not sock.poll(0) for sock in socks)  # a subscriber without the key got no plan
    for sock in socks:
        sock.close()
    ctx.term()


@pytest.mark.parametrize("victim_node", [1, 0])
def test_two_nodes_on_one_machine(victim_node, tiny_models, tmp_path):
    """``--nnodes 2``: node 0 serves HTTP with rank 0, node 1 runs rank 1 and reaches node 0 over tcp://; greedy
    tokens as one rank's; a rank killed on either node ends both launches, non-zero, within seconds."""
    _needs(2)
    path = str(tiny_models["llama"])
    expected = _greedy(tiny_models["llama"], 1)[: len(PROMPTS)]
    port = _free_port_run()
    flags = ["--model-path", path, "--tp", "2", "--nnodes", "2", "--dtype", "float32", "--max-total-tokens",
             "4096", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-auth-key-file", str(tmp_path / "dist.key")]
    log = open(tmp_path / "node1.log", "w+")
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", *flags, "--node-rank", "1"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        node0 = ServerProcess(*flags, "--node-rank", "0")
        try:
            assert _generate(node0.url) == expected
            ranks = get_body(node0.url + "/get_server_info")["ranks"]
            assert {node: [r["rank"] for r in rs] for node, rs in ranks.items()} == {"0": [0], "1": [1]}
            if victim_node == 1:
                # the store, the plans and the nodes' link listen on --dist-init-addr's address only
                assert _listening({port, port + 1, port + 2}) == {(a, "127.0.0.1") for a in (port, port + 1,
                                                                                             port + 2)}
                _rogues_on(port)
                assert _generate(node0.url) == expected  # nothing changed
                out = node0.output()
                assert "on the plans' port that do not hold the multi-node key" in out
                assert "on the nodes' link that do not hold the multi-node key" in out
            killed = time.monotonic()
            os.kill(ranks[str(victim_node)][0]["pid"], signal.SIGKILL)
            assert _ends(node0.proc, 20) != 0 and _ends(node1, 20) != 0
            assert time.monotonic() - killed < 15
        finally:
            node0.stop()
    finally:
        if node1.poll() is None:
            node1.kill()
        log.seek(0)
        print(log.read())


def test_a_rank_reads_only_its_share_of_the_checkpoint(smollm2_path):
    """Rank 1 of 3 reads a third of every split tensor from the safetensors file (norms whole), never the
    whole model; the shares of all ranks tile each tensor exactly."""
    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_configs
    from radixserve.model.parallel import TPGroup, shard_of
    from radixserve.model.runner import iter_safetensors

    cfg = ModelConfig.from_hf(*load_configs(smollm2_path))
    full = {name: t.shape for name, t in iter_safetensors(smollm2_path)}
    parts = [dict(iter_safetensors(smollm2_path, lambda n, r=r: shard_of(cfg, TPGroup(r, 3), n))) for r in range(3)]
    whole = sum(s.numel() for s in full.values())
    mine = sum(t.numel() for t in parts[1].values())
    norms = sum(s.numel() for n, s in full.items() if "norm" in n)
    assert mine == pytest.approx((whole - norms) / 3 + norms)
    import torch
    from safetensors import safe_open

    name = "model.layers.3.self_attn.o_proj.weight"  # row-parallel: split along its input columns
    with safe_open(next(smollm2_path.glob("*.safetensors")), framework="pt") as f:
        assert torch.equal(torch.cat([p[name] for p in parts], dim=1), f.get_tensor(name))


def test_kv_heads_and_vocabulary_shares():
    from radixserve.model.parallel import TPGroup

    assert [TPGroup(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # copies
    assert [TPGroup(r, 2).kv_heads(4) for r in range(2)] == [(0, 2), (2, 2)]
    assert [TPGroup(r, 2).vocab(7) for r in range(2)] == [(0, 4, 4), (4, 4, 3)]  # the last shard padded


def test_nodes_started_with_other_settings_are_refused(tiny_models, tmp_path):
    """Node 1 given another --dtype than node 0: node 0 refuses to start, naming the difference; both end."""
    _needs(2)
    flags = ["--model-path", str(tiny_models["llama"]), "--tp", "2", "--nnodes", "2", "--max-total-tokens", "4096",
             "--dist-init-addr", f"127.0.0.1:{_free_port_run()}", "--dist-auth-key-file", str(tmp_path / "dist.key")]
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", *flags, "--node-rank", "1",
                              "--dtype", "bfloat16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(RuntimeError, match="node 1 was started with other settings: dtype float32 here, "
                                               "bfloat16 there"):
            ServerProcess(*flags, "--node-rank", "0", "--dtype", "float32")
        assert _ends(node1, 20) != 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_nodes_with_different_keys_refuse_to_pair(tiny_models, tmp_path):
    """Node 1 holds another key than node 0: its ranks never get a plan, node 0 counts it as a stranger, and
    both end within --dist-timeout, saying why."""
    _needs(2)
    from radixserve.actors.node_auth import node_keys

    node_keys(tmp_path / "other.key", create=True)
    flags = ["--model-path", str(tiny_models["llama"]), "--tp", "2", "--nnodes", "2", "--max-total-tokens", "4096",
             "--dtype", "float32", "--dist-init-addr", f"127.0.0.1:{_free_port_run()}", "--dist-timeout", "10"]
    log = open(tmp_path / "node1.log", "w+")
    node1 = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", *flags, "--node-rank", "1",
                              "--dist-auth-key-file", str(tmp_path / "other.key")],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        with pytest.raises(RuntimeError) as failed:
            ServerProcess(*flags, "--node-rank", "0", "--dist-auth-key-file", str(tmp_path / "node0.key"))
        assert "do not hold the multi-node key" in str(failed.value)  # node 0's log, in the error
        assert _ends(node1, 30) != 0
        log.seek(0)
        assert "not heard from in 10s" in log.read()
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_raises_on_a_rank_ends_that_rank(rank, tiny_models):
    """With one rank a failed step comes back as an error and the runner goes on (test_actor_isolation); with
    several, the other ranks' collectives could no longer be paired with this one's, so the rank ends (raises)."""
    from pathlib import Path

    from radixserve.model.config import ModelConfig
    from radixserve.model.loader import load_configs
    from radixserve.model.parallel import TPGroup
    from radixserve.model.runner import ModelRunner
    from radixserve.sampling_params import SamplingParams

    path = Path(tiny_models["llama"])
    with Engine(str(path), dtype="float32", max_total_tokens=300) as engine:
        engine.scheduler.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0))
        plan = engine.scheduler.schedule()
    cfg = ModelConfig.from_hf(*load_configs(path))
    runner = ModelRunner(cfg, path, dtype="float32", num_slots=300, tp=TPGroup(rank, 2))  # no collective is reached

    def broken(batch):
        raise RuntimeError("out of memory")

    runner.model = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.forward(plan)
