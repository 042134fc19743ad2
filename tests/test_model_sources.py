"""Where a model comes from: hub ids in the local Hugging Face cache (HF_HOME, offline), --tokenizer-path,
--chat-template, --served-model-name aliases, --random-seed, and checkpoints that ask for remote code."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.engine import Engine
from radixserve.model.loader import resolve_model

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def fake_hf_home(root: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """``root`` laid out as HF_HOME after ``hf download repo_id``: hub/models--org--name/{refs/main,
    snapshots/<commit>/...} (files copied, where the hub would link them to blobs)."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def resolve_in_subprocess(env: dict[str, str], *names: str) -> subprocess.CompletedProcess:
    """resolve_model in a fresh interpreter: huggingface_hub reads HF_HOME / HF_HUB_CACHE when it is imported."""
    code = ("import sys\nfrom radixserve.model.loader import resolve_model\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n        f = resolve_model(name)\n        print(f.path, f.hub_id, f.given)\n"
            "    except (FileNotFoundError, ValueError) as exc:\n        print('ERROR', exc)\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    return subprocess.run([sys.executable, "-c", code, *names], env={**clean, **env, "HF_HUB_OFFLINE": "0"},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_models) -> Path:
    root = tmp_path_factory.mktemp("hf_home")
    fake_hf_home(root, REPO, tiny_models["llama"])
    return root


def test_hub_id_resolves_from_the_hf_home_cache(hf_home):
    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    proc = resolve_in_subprocess({"HF_HOME": str(hf_home)}, REPO, f"{REPO}@{COMMIT}", f"{REPO}@main")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == [f"{snapshot} {REPO} {REPO}"] * 3, "main, the commit and @main are one snapshot"


def test_hf_hub_cache_wins_over_hf_home(hf_home, tmp_path):
    """As huggingface_hub reads them: HF_HUB_CACHE names the cache itself, HF_HOME only its parent."""
    proc = resolve_in_subprocess({"HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(hf_home / "hub")}, REPO)
    assert proc.stdout.startswith(str(hf_home / "hub")), proc.stdout + proc.stderr


def test_a_missing_hub_id_names_the_id_the_cache_and_what_to_do(hf_home):
    proc = resolve_in_subprocess({"HF_HOME": str(hf_home)}, "tiny-org/absent", f"{REPO}@v9")
    absent, revision = proc.stdout.splitlines()
    assert absent.startswith("ERROR 'tiny-org/absent' is not a local path")
    assert str(hf_home / "hub") in absent and "hf download tiny-org/absent" in absent
    assert "never downloads" in absent and "local checkpoint folder" in absent
    assert "at revision 'v9'" in revision and f"hf download {REPO} --revision v9" in revision


def test_serve_with_a_missing_hub_id_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--model-path", "nobody/nothing"],
                          env={**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "'nobody/nothing' is not a local path" in errors[0] and "Traceback" not in \
        proc.stderr


def test_a_local_path_wins_over_a_hub_id(tiny_models, tmp_path, monkeypatch):
    local = tmp_path / "tiny-org" / "tiny-llama"
    shutil.copytree(tiny_models["llama"], local)
    monkeypatch.chdir(tmp_path)
    files = resolve_model(REPO)  # no cache holds it: a lookup would fail
    assert files.path == Path(REPO) and files.hub_id is None and files.given == REPO


def test_non_hub_spellings_keep_the_missing_path_error():
    for name in ("/no/such/model", "./rel/model", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist; radixserve loads local checkpoints"):
            resolve_model(name)


def test_a_hub_id_is_served_by_its_aliases_with_a_builtin_chat_template(hf_home):
    """End to end: `radixserve serve --model-path org/name` from HF_HOME, two served names, --chat-template, a
    --tokenizer-path hub id at a revision."""
    import httpx

    from radixserve.actors.tokenizer import TokenizerCore
    from radixserve.server_process import ServerProcess

    snapshot = hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    server = ServerProcess("--model-path", REPO, "--dtype", "float32", "--max-total-tokens", "1200",
                           "--served-model-name", "tiny", "tiny-alias", "--chat-template", "llama-3",
                           "--tokenizer-path", f"{REPO}@{COMMIT}",
                           env={"HF_HOME": str(hf_home)})
    try:
        url = server.url
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"] and {m["root"] for m in models} == {"tiny"}
        for name, named in (("tiny-alias", "tiny-alias"), (None, "tiny")):
            body = {"messages": FRANCE, "max_tokens": 3, "temperature": 0, **({"model": name} if name else {})}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["model"] == named, r.text
        wrong = httpx.post(url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}, timeout=60)
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        assert "`tiny`, `tiny-alias`" in wrong.json()["error"]["message"]
        info = httpx.get(url + "/get_model_info", timeout=30).json()
        assert info["model_path"] == REPO and info["served_model_name"] == "tiny"
        assert info["tokenizer_path"] == f"{REPO}@{COMMIT}", "as given, as SGLang reports it"
        assert info["chat_template"]["roles"]["user"][0] == "<|start_header_id|>user<|end_header_id|>\n\n"
        used = httpx.post(url + "/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 1}, timeout=60)
        llama3 = TokenizerCore(snapshot, "llama-3").apply_chat_template(FRANCE)
        assert used.json()["usage"]["prompt_tokens"] == len(llama3) != len(TokenizerCore(snapshot).apply_chat_template(
            FRANCE)), "the llama-3 template's rendering, not SmolLM2's own"
    finally:
        server.stop()


# -- --chat-template and --tokenizer-path, through the offline Engine -----------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_models) -> str:
    return str(tiny_models["llama"])


def test_builtin_chat_templates_override_the_tokenizers(llama):
    from radixserve.actors.jinja_templates import BUILTIN_TEMPLATES

    with Engine(llama, dtype="float32", max_total_tokens=300, chat_template="llama-3") as engine:
        tok = engine.tokenizer
        text = tok.tokenizer.bos_token + "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of " \
            "France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        assert tok.tokenizer.chat_template == BUILTIN_TEMPLATES["llama-3"]
        assert tok.apply_chat_template(FRANCE) == tok.tokenizer(text, add_special_tokens=False).input_ids
        assert engine.model_info()["chat_template"]["roles"]["assistant"] == [
            "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"]
        assert engine.chat(FRANCE, {"max_new_tokens": 2})["meta_info"]["prompt_tokens"] == len(
            tok.apply_chat_template(FRANCE))


@pytest.mark.parametrize("name", ["chatml", "qwen", "llama-3", "llama-2", "mistral"])
def test_every_builtin_renders_a_system_user_assistant_chat(llama, name):
    from radixserve.actors.tokenizer import TokenizerCore

    core = TokenizerCore(llama, name)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    text = core.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.index("Be brief.") < text.index("Hi") < text.index("Hello!") < text.index("Bye")
    want = {"chatml": "<|im_start|>assistant\n", "qwen": "<|im_start|>assistant\n",
            "llama-3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "llama-2": "[INST] Bye [/INST]",
            "mistral": "[INST] Bye [/INST]"}[name]
    assert text.endswith(want), text


def test_a_chat_template_file_and_a_bad_name(llama, tmp_path):
    from radixserve.actors.tokenizer import TokenizerCore

    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
    core = TokenizerCore(llama, str(jinja))
    assert core.decode(core.apply_chat_template(FRANCE)) == "<user>What is the capital of France?\n<assistant>"
    with pytest.raises(ValueError, match="neither a file nor a built-in template; the built-ins are chatml, "
                                         "llama-2, llama-3, mistral, qwen"):
        Engine(llama, chat_template="llama3")  # refused before the model loads


def test_tokenizer_path_takes_the_tokenizer_and_its_template_from_elsewhere(llama, tmp_path):
    other = tmp_path / "tok"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(llama) / name).exists():
            shutil.copy(Path(llama) / name, other / name)
    (other / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with Engine(llama, dtype="float32", max_total_tokens=300, tokenizer_path=str(other)) as engine:
        assert engine.tokenizer.decode(engine.tokenizer.apply_chat_template(FRANCE)) == \
            "[What is the capital of France?]"
        assert engine.model_info()["tokenizer_path"] == str(other)
    with pytest.raises(FileNotFoundError, match="is not a folder with tokenizer files"):
        Engine(llama, tokenizer_path=str(tmp_path))


# -- --random-seed ---------------------------------------------------------------------------------------------------
def sampled(llama: str, seed: int | None) -> list[list[int]]:
    with Engine(llama, dtype="float32", max_total_tokens=300, random_seed=seed) as engine:
        params = {"temperature": 1.0, "max_new_tokens": 12}
        return [engine.generate(p, params)["output_ids"] for p in ("one", "two")]


def test_the_same_random_seed_gives_the_same_sampled_tokens(llama):
    first = sampled(llama, 7)
    assert sampled(llama, 7) == first
    assert sampled(llama, 8) != first, "another seed, other noise"


# -- remote code -----------------------------------------------------------------------------------------------------
def test_a_checkpoint_asking_for_remote_code_is_refused_by_name(tmp_path):
    config = {"model_type": "phi-custom", "architectures": ["PhiCustomForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_phi.PhiConfig",
                           "AutoModelForCausalLM": "modeling_phi.PhiForCausalLM"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"phi-custom model whose config.json asks for its own code \(auto_map: "
                                         r"AutoConfig, AutoModelForCausalLM\); radixserve runs only the "
                                         r"architectures it implements \(.*llama.*\) and never executes"):
        resolve_model(tmp_path)


def test_trust_remote_code_is_refused(llama):
    with pytest.raises(ValueError, match=r"--trust-remote-code: radixserve runs only the architectures it implements "
                                         r"\(.*qwen2.*\); remote code is never executed"):
        Engine(llama, trust_remote_code=True)
