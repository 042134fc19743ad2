"""KV tiers in a running server: a restart after kill -9 serves the stored pages and never a damaged one, a
different model or dtype never reads them, two servers share one Redis, /flush_cache keeps storage when asked,
the write and prefetch policies switch live, and /metrics shows the tiers (fp32 tiny Llama)."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import get_body, post_json
from radixserve.server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPTS = [[random.Random(s).randrange(100, 5000) for _ in range(200)] for s in range(6)]


def server(model: Path, *extra: str) -> ServerProcess:
    return ServerProcess("--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "700",
                         "--decode-kernel", "eager", "--check-invariants", "--enable-hierarchical-cache",
                         "--page-size", "16", *extra)


def generate(s: ServerProcess, ids: list[int]) -> dict:
    return post_json(s.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8,
                                                                                  "temperature": 0}})


def tiers(s: ServerProcess) -> dict:
    return get_body(s.url + "/cache/stats")["tiers"]


def written(check, timeout: float = 60.0) -> None:
    """Wait until ``check()`` holds: storage writes land in the background (within about a second on a busy
    machine: model/kv_tiers.py's STORE_DEADLINE_S)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the pages never reached storage"
        time.sleep(0.05)


def page_files(folder: Path) -> int:
    """The pages stored in ``folder``; -1 while a clear removes the folders under the count."""
    try:
        return len(list(folder.glob("*/*.page")))
    except FileNotFoundError:
        return -1


FULL_PAGES = 3 * 12  # PROMPTS[:3]'s full pages of 16 of their 200 tokens


@pytest.fixture(scope="module")
def expected(tiny_models):
    """Every prompt's greedy tokens, computed (no cache of any kind)."""
    s = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--decode-kernel", "eager",
                      "--disable-radix-cache")
    try:
        return [generate(s, p)["output_ids"] for p in PROMPTS]
    finally:
        s.stop()


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def test_a_server_killed_mid_write_restarts_serving_its_pages_and_never_a_damaged_one(tiny_models, expected,
                                                                                      tmp_path):
    pages = tmp_path / "pages"
    config = json.dumps({"path": str(pages)})
    first = server(tiny_models["llama"], "--hicache-storage-backend-extra-config", config)
    traffic = threading.Thread(target=lambda: [_ignore(generate, first, p) for p in PROMPTS * 3], daemon=True)
    try:
        for p, want in zip(PROMPTS[:3], expected):
            assert generate(first, p)["output_ids"] == want
        written(lambda: page_files(pages) >= FULL_PAGES)
        traffic.start()
        time.sleep(1.0)
    finally:  # kill -9, every process of it: nothing gets to finish a write or clean up
        for pid in [first.proc.pid, *descendants(first.proc.pid)]:
            _ignore(os.kill, pid, signal.SIGKILL)
        first.proc.wait()
        traffic.join(30)
    files = sorted(pages.glob("*/*.page"))
    truncated, flipped, foreign = files[0], files[1], files[2]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    foreign.write_bytes(files[3].read_bytes())  # a whole, valid page, under another page's key
    damaged = {path: path.read_bytes() for path in (truncated, flipped, foreign)}
    torn = truncated.parent / f"{truncated.stem}.{first.proc.pid}.1.tmp"  # named by the killed launcher
    torn.write_bytes(b"a write that never finished")

    second = server(tiny_models["llama"], "--hicache-storage-backend-extra-config", config)
    try:
        for _ in range(2):
            for p, want in zip(PROMPTS, expected):
                assert generate(second, p)["output_ids"] == want
        t = tiers(second)
        assert t["hit_tokens"]["L3"] > 0, t
        assert t["runner"]["l3_pages_damaged"] >= 1, t  # whichever of the three damaged pages a request reached
        assert not torn.exists(), "the unfinished write was cleaned up at start"
        metrics = urllib.request.urlopen(second.url + "/metrics", timeout=30).read().decode()
        assert 'radixserve_kv_tier_hit_tokens{tier="L3"}' in metrics
        assert "radixserve_kv_tier_damaged_pages" in metrics
    finally:
        second.stop()
    rewritten = [path for path, data in damaged.items() if not path.exists() or path.read_bytes() != data]
    assert len(rewritten) >= t["runner"]["l3_pages_damaged"], "a damaged page that was read is gone (or recomputed)"


def _ignore(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


def test_another_dtype_or_model_never_reads_the_pages(tiny_models, tmp_path):
    config = json.dumps({"path": str(tmp_path / "pages")})
    s = server(tiny_models["llama"], "--hicache-storage-backend-extra-config", config)
    try:
        generate(s, PROMPTS[0])
    finally:
        s.stop()
    stored = sorted(p.name for p in (tmp_path / "pages").glob("*/*.page"))
    assert stored
    for model, dtype in ((tiny_models["llama"], "bfloat16"), (tiny_models["qwen2"], "float32")):
        other = ServerProcess("--model-path", str(model), "--dtype", dtype, "--max-total-tokens", "700",
                              "--decode-kernel", "eager", "--enable-hierarchical-cache", "--page-size", "16",
                              "--hicache-storage-backend-extra-config", config)
        try:
            meta = generate(other, PROMPTS[0])["meta_info"]
            assert meta["cached_tokens_details"]["storage"] == 0, (model.name, dtype)
            t = tiers(other)
            assert t["runner"].get("l3_pages_damaged", 0) == 0, "it did not even read them"
        finally:
            other.stop()
    assert set(stored) <= {p.name for p in (tmp_path / "pages").glob("*/*.page")}, "and left them alone"


@pytest.fixture
def redis_url(tmp_path):
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: `make test` installs it (Debian's redis-server)")
        pytest.skip("redis-server is missing: `sudo apt-get install redis-server` (make test does, as root)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_two_servers_share_one_redis(tiny_models, expected, redis_url):
    config = json.dumps({"url": redis_url})
    a = server(tiny_models["llama"], "--hicache-storage-backend", "redis",
               "--hicache-storage-backend-extra-config", config)
    b = server(tiny_models["llama"], "--hicache-storage-backend", "redis",
               "--hicache-storage-backend-extra-config", config)
    try:
        for p, want in zip(PROMPTS[:3], expected):
            assert generate(a, p)["output_ids"] == want
        import redis

        written(lambda: redis.Redis.from_url(redis_url).dbsize() >= FULL_PAGES)
        for p, want in zip(PROMPTS[:3], expected):
            out = generate(b, p)
            assert out["output_ids"] == want
            assert out["meta_info"]["cached_tokens_details"]["storage"] >= 192, out["meta_info"]
    finally:
        a.stop()
        b.stop()


def test_flush_policies_and_stats(tiny_models, expected, tmp_path):
    s = server(tiny_models["llama"], "--hicache-storage-backend-extra-config",
               json.dumps({"path": str(tmp_path / "pages")}))
    try:
        assert generate(s, PROMPTS[0])["output_ids"] == expected[0]
        written(lambda: page_files(tmp_path / "pages") >= 12)
        flushed = post_json(s.url + "/flush_cache?keep_storage=true", {})
        assert flushed["flushed"] == ["L1", "L2"]
        out = generate(s, PROMPTS[0])
        assert out["output_ids"] == expected[0] and out["meta_info"]["cached_tokens_details"]["storage"] == 192
        assert post_json(s.url + "/flush_cache", {})["flushed"] == ["L1", "L2", "L3"]
        written(lambda: page_files(tmp_path / "pages") == 0)  # cleared after the writes queued before it
        assert generate(s, PROMPTS[0])["meta_info"]["cached_tokens"] == 0, "nothing is left anywhere"
        policies = post_json(s.url + "/policies", {"write": "write_back", "prefetch": "wait_complete"})
        assert policies["write"]["current"] == "write_back" and policies["prefetch"]["current"] == "wait_complete"
        assert "write_through_selective" in policies["write"]["available"]
        req = urllib.request.Request(s.url + "/policies", data=json.dumps({"write": "nope"}).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(err.value.read())
        assert err.value.code == 400 and body["error"]["param"] == "write", body
        usage = post_json(s.url + "/v1/completions", {"model": "llama", "prompt": PROMPTS[1], "max_tokens": 2,
                                                      "temperature": 0})["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
        stats = tiers(s)
        assert stats["write_policy"] == "write_back" and stats["page_size"] == 16
    finally:
        s.stop()


def test_dp_replicas_share_one_storage_tier(tiny_models, expected, tmp_path):
    """--dp 2 with round-robin routing: a prompt's second request goes to the other replica, whose pool and host
    memory never saw it; its pages come from the storage both replicas write to."""
    s = server(tiny_models["llama"], "--dp", "2", "--routing-policy", "round-robin",
               "--hicache-storage-backend-extra-config", json.dumps({"path": str(tmp_path / "pages")}))
    try:
        for p, want in zip(PROMPTS[:3], expected):  # replicas 0, 1, 0
            assert generate(s, p)["output_ids"] == want
        written(lambda: page_files(tmp_path / "pages") >= FULL_PAGES)  # from each replica's writers
        second = [generate(s, p) for p in PROMPTS[:3]]  # replicas 1, 0, 1: each prompt on the other one
        assert [o["output_ids"] for o in second] == expected[:3]
        assert all(o["meta_info"]["cached_tokens_details"]["storage"] == 192 for o in second), \
            [o["meta_info"] for o in second]
    finally:
        s.stop()
