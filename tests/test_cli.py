"""The command line: `radixserve demo` runs a scripted chat when stdin is not a terminal; the serve flags (types,
choices, --no- switches, defaults, sections, SGLang aliases) and their one-line errors with close matches."""
from __future__ import annotations

import subprocess
import sys

import pytest


def test_demo_runs_a_scripted_chat_and_reuses_the_cache(tiny_models):
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "demo", "--model-path", str(tiny_models["llama"]), "--dtype", "float32",
         "--max-new-tokens", "8", "--max-total-tokens", "2048"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    cached = [line for line in proc.stdout.splitlines() if "prompt tokens from the radix cache" in line]
    assert len(cached) == 3
    assert not cached[1].strip().startswith("[0/"), "the second turn reuses the first"


def test_bad_flag_value_is_a_clear_error(tiny_models):
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "demo", "--model-path", str(tiny_models["llama"]),
         "--eviction-policy", "nope"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "unknown eviction policy 'nope'" in proc.stderr


# -- the flags themselves (parse-level: no model is loaded) ----------------------------------------------------------
def serve_parser():
    from radixserve.cli_args import server_parser

    return server_parser()


def parse(*argv: str):
    from radixserve.cli_args import from_cli

    return from_cli(serve_parser().parse_args(list(argv)))


def test_every_field_is_a_typed_flag_in_a_section():
    from dataclasses import fields

    from radixserve.cli_args import GROUPS
    from radixserve.server_args import RESOLVED, ServerArgs

    grouped = [name for names in GROUPS.values() for name in names]
    flags = sorted(f.name for f in fields(ServerArgs) if f.name not in RESOLVED)  # resolved() sets the others
    assert sorted(grouped) == flags, "each field in exactly one section"
    assert not any(f"--{name.replace('_', '-')}" in serve_parser().format_help() for name in RESOLVED)
    args = parse("--max-total-tokens", "4096", "--shadow-window", "2.5", "--port", "8000", "--api-key", "k",
                 "--random-seed", "3", "--served-model-name", "a", "b")
    assert (args.max_total_tokens, args.shadow_window, args.port, args.api_key, args.random_seed) == \
        (4096, 2.5, 8000, "k", 3)
    assert args.served_model_name == ("a", "b")
    assert parse() == __import__("radixserve.server_args", fromlist=["x"]).ServerArgs(), "defaults are the fields'"


def test_every_switch_can_be_turned_off():
    from dataclasses import fields

    from radixserve.server_args import ServerArgs

    switches = [f.name for f in fields(ServerArgs) if f.type == "bool"]
    assert {"disable_radix_cache", "auto_policy", "deterministic", "check_invariants"} <= set(switches)
    flags = {s for a in serve_parser()._actions for s in a.option_strings}
    for name in switches:
        flag = name.replace("_", "-")
        assert f"--{flag}" in flags and f"--no-{flag}" in flags
    assert parse("--disable-radix-cache").disable_radix_cache is True
    assert parse("--disable-radix-cache", "--no-disable-radix-cache").disable_radix_cache is False
    assert parse("--enable-deterministic-inference").deterministic is True


def test_sglang_spellings_are_aliases():
    args = parse("--model", "m", "--tp-size", "2", "--dp-size", "1", "--radix-eviction-policy", "lfu")
    assert (args.model_path, args.tp, args.dp, args.eviction_policy) == ("m", 2, 1, "lfu")
    assert parse("--dtype", "bf16", "--kv-cache-dtype", "bf16").kv_cache_dtype == "bfloat16"


def test_help_lists_sections_choices_and_defaults():
    text = serve_parser().format_help()
    for section in ("model and tokenizer:", "runtime and memory:", "scheduling and cache policies:",
                    "parallelism:", "api server:", "logging:", "debugging:"):
        assert f"\n{section}\n" in text
    for choices in ("{auto,bfloat16,float16,float32,", "{auto,cpu,cuda}", "{int8,int4,gguf,none}",
                    "{auto,native,compiled,eager}", "{auto,gloo,nccl}", "{debug,info,warning,error,critical}",
                    "{auto,triton,torch,batch-invariant}", "{ttft_mean_s,", "fp8_e5m2"):
        assert choices in text
    flat = " ".join(text.split())
    for shown in ("(default: 2048)", "(default: fcfs)", "(default: 127.0.0.1)", "(default: off)",
                  "(default: from free memory", "(default: the bundled SmolLM2-135M-Instruct)"):
        assert shown in flat
    assert "None" not in text, "a None default says what it means instead"
    assert "lru" in flat and "cache-aware" in flat, "plugin-extensible names are listed from the registries"
    assert "--no-disable-radix-cache" in text and "--served-model-name NAME [NAME ...]" in text


def test_none_defaults_say_what_they_mean():
    from dataclasses import fields

    from radixserve.cli_args import HELP
    from radixserve.server_args import ServerArgs

    for f in fields(ServerArgs):
        if f.default is None:
            assert "(default:" in HELP[f.name], f.name


def test_launch_server_takes_the_same_flags():
    proc = subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--help"], capture_output=True,
                          text=True, timeout=120)
    serve = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--help"], capture_output=True, text=True,
                           timeout=120)
    assert proc.returncode == serve.returncode == 0
    assert proc.stdout == serve.stdout and "--served-model-name" in proc.stdout


def run_main(capsys, *argv: str) -> tuple[int, str]:
    from radixserve.__main__ import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--max-totl-tokens", "10"], "radixserve serve: error: unrecognized argument --max-totl-tokens; did you mean "
                                  "--max-total-tokens?"),
    (["--max-total-tokens=10", "--chunkd-prefill-size=5"], "unrecognized argument --chunkd-prefill-size; did you "
                                                           "mean --chunked-prefill-size?"),
    (["--max", "10"], "radixserve serve: error: ambiguous option: --max could match --max-total-tokens, "),
    (["--dtype", "fp8"], "radixserve serve: error: argument --dtype: invalid choice: 'fp8'"),
    (["--tp", "x"], "argument --tp/--tp-size/--tensor-parallel-size: invalid int value: 'x'"),
    (["--tp", "0"], "error: tp=0 must be >= 1"),
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype float16 is not implemented: the KV pool holds the model's"),
    (["--trust-remote-code"], "remote code is never executed"),
    (["--chat-template", "nope"], "--chat-template 'nope' is neither a file nor a built-in template"),
    (["model-dir"], "unrecognized arguments: model-dir (every setting is a --flag"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, tiny_models, argv, message):
    code, err = run_main(capsys, "serve", "--model-path", str(tiny_models["llama"]), *argv)
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1, err


def test_demo_and_router_parsers_name_close_flags_too(capsys):
    assert run_main(capsys, "demo", "--max-new-token", "3") == (
        2, "radixserve demo: error: unrecognized argument --max-new-token; did you mean --max-new-tokens?\n")
    code, err = run_main(capsys, "sreve")
    assert code == 2 and "invalid choice: 'sreve'" in err


def test_server_flags_take_sglangs_abbreviations(capsys, tiny_models):
    """SGLang's launcher takes a flag's unique prefix (``--context-len``); so does the server's, both ways in."""
    from radixserve.cli_args import from_cli, server_parser

    args = from_cli(server_parser().parse_args(["--context-len", "512", "--max-total-tok=900", "--chunked-pre", "64"]))
    assert (args.context_length, args.max_total_tokens, args.chunked_prefill_size) == (512, 900, 64)
    code, err = run_main(capsys, "serve", "--model-path", str(tiny_models["llama"]), "--context-len", "1")
    assert code == 2 and "context_length=1 is too small" in err, "--context-len was read as --context-length"
