"""Named logit processors: off unless listed, refused by name or as SGLang's serialized code with a clear 400, run
once per step over the rows that use them, and the greedy output changed exactly as the processor says (built-ins
through the offline Engine, a third-party plugin through a live server)."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from radixserve.cli_args import from_cli, server_parser
from radixserve.errors import InvalidRequest
from radixserve.logit_processors import ProcessorCatalog
from radixserve.model.logit_processing import LogitProcessing
from radixserve.model.token_processors import AllowTokens, BanTokens
from radixserve.sampling_params import SamplingParams
from radixserve.wire.plans import ProcessorSpec

from conftest import ServerProcess, install_apart

PLUGIN = Path(__file__).parent / "logit_plugin_pkg"
DILL = '{"callable": "8004952e000000000000008c0a64696c6c2e5f64696c6c948c105f6372656174655f74797065949394"}'
GREEDY = {"temperature": 0, "ignore_eos": True}


# -- requests -----------------------------------------------------------------------------------------------
def test_serialized_code_and_what_is_not_a_name_are_refused_naming_the_field():
    with pytest.raises(InvalidRequest, match="serialized Python code.*never runs code.*--logit-processors") as err:
        SamplingParams(custom_logit_processor=DILL)
    assert err.value.param == "custom_logit_processor"
    with pytest.raises(InvalidRequest, match="is not a processor name"):
        SamplingParams(custom_logit_processor="rm -rf /")
    with pytest.raises(InvalidRequest, match="custom_params=.* takes 10.... bytes as JSON; at most 65536") as err:
        SamplingParams(custom_logit_processor="ban-tokens", custom_params={"token_ids": list(range(20000))})
    assert err.value.param == "custom_params"


def test_the_catalog_names_the_flag_the_enabled_processors_and_bad_parameters():
    with pytest.raises(InvalidRequest, match="runs no logit processors.*--logit-processors NAME.*ban-tokens"):
        ProcessorCatalog().check("ban-tokens", None, 100)
    ProcessorCatalog().check(None, {"ignored": 1}, 100)
    catalog = ProcessorCatalog(("ban-tokens", "allow-tokens"))
    with pytest.raises(InvalidRequest, match="'ban-token' is not enabled.*allow-tokens, ban-tokens.*'ban-tokens'"):
        catalog.check("ban-token", None, 100)
    with pytest.raises(InvalidRequest, match="token id 100 is outside the vocabulary") as err:
        catalog.check("ban-tokens", {"token_ids": [5, 100]}, 100)
    assert err.value.param == "custom_params"
    with pytest.raises(InvalidRequest, match="at least one"):
        catalog.check("allow-tokens", {}, 100)
    with pytest.raises(InvalidRequest, match="unknown parameter 'ids'"):
        catalog.check("ban-tokens", {"ids": [1]}, 100)
    catalog.check("allow-tokens", {"token_id": 7}, 100)  # SGLang's DeterministicLogitProcessor's parameter
    with pytest.raises(ValueError, match="unknown logit processor 'nope'"):
        ProcessorCatalog(("nope",))


def test_flags():
    args = from_cli(server_parser().parse_args(["--logit-processors", "ban-tokens", "allow-tokens"]))
    assert args.logit_processors == ("ban-tokens", "allow-tokens") and not args.enable_custom_logit_processor
    assert from_cli(server_parser().parse_args([])).logit_processors is None
    with pytest.raises(ValueError, match="never runs code sent in a request.*--logit-processors"):
        from_cli(server_parser().parse_args(["--enable-custom-logit-processor"]))


# -- the runner's side, with stand-ins -------------------------------------------------------------------
class Recording:
    """Adds ``params["add"]`` to every logit of its rows; records each call's rows."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[dict], list[int]]] = []

    def __call__(self, logits, params, output_index):
        self.calls.append((params, output_index))
        logits += torch.tensor([p["add"] for p in params])[:, None]


class Raising:
    def __call__(self, logits, params, output_index):
        raise RuntimeError("broken")


def test_each_processor_runs_once_per_step_over_its_rows_and_a_broken_one_fails_only_its_rows():
    proc = LogitProcessing()
    proc.processors = {"rec": (rec := Recording()), "bad": Raising(), "ban": BanTokens()}
    proc.update({"a": ProcessorSpec("rec", {"add": 1.0}), "b": ProcessorSpec("rec", {"add": 10.0}),
                 "c": ProcessorSpec("bad", {}), "d": ProcessorSpec("ban", {"token_ids": [0, 2]})}, [])
    logits = torch.zeros(6, 4)
    errors = proc.apply(logits, ["a", None, "b", "c", "d", "gone"], [3, 0, 5, 1, 2, 0])
    assert rec.calls == [([{"add": 1.0}, {"add": 10.0}], [3, 5])], "one call with both rows, in batch order"
    assert logits[0].tolist() == [1.0] * 4 and logits[2].tolist() == [10.0] * 4 and logits[1].tolist() == [0.0] * 4
    assert logits[4].tolist() == [float("-inf"), 0.0, float("-inf"), 0.0]
    assert set(errors) == {3, 5} and "broken" in errors[3] and "lost" in errors[5]
    proc.update({}, ["a", "b"])
    assert set(proc.live) == {"c", "d"}


def test_the_built_ins_change_a_whole_batch_at_once():
    logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out = AllowTokens()(logits.clone(), [{"token_ids": [1, 3]}, {"token_id": 0}, {"token_ids": [2]}], [0, 0, 0])
    inf = float("-inf")
    assert out.tolist() == [[inf, 1.0, inf, 3.0], [4.0, inf, inf, inf], [inf, inf, 10.0, inf]]
    banned = logits.clone()
    BanTokens()(banned, [{"token_ids": [3]}, {"token_ids": []}, {"token_id": 0}], [0, 0, 0])
    assert banned.argmax(-1).tolist() == [2, 3, 3]


# -- the offline Engine: greedy outputs, batched calls ------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_models):
    from radixserve import Engine

    e = Engine(str(tiny_models["llama"]), dtype="float32", max_total_tokens=1000, check_invariants=True,
               logit_processors=["ban-tokens", "allow-tokens"])
    yield e
    e.shutdown()


def test_greedy_output_changes_exactly_as_the_processor_says_and_calls_are_batched(engine):
    prompts = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35]]
    params = dict(GREEDY, max_new_tokens=6)
    plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    first = [r["output_ids"][0] for r in plain]
    calls: list[tuple[list[dict], list[int]]] = []
    ban = engine.runner.processing.processors["ban-tokens"]

    def counting(logits, params, output_index):
        calls.append((params, output_index))
        return ban(logits, params, output_index)

    engine.runner.processing.processors["ban-tokens"] = counting
    try:
        out = engine.generate(input_ids=prompts, custom_logit_processor=["ban-tokens", None, "ban-tokens"],
                              sampling_params=[dict(params, custom_params={"token_ids": [first[0]]}), params,
                                               dict(params, custom_params={"token_ids": [first[2]]})])
    finally:
        engine.runner.processing.processors["ban-tokens"] = ban
    assert out[1]["output_ids"] == plain[1]["output_ids"], "a request without a processor is untouched"
    for k in (0, 2):
        runner_up = plain[k]["meta_info"]["output_top_logprobs"][0][1][1]  # the model's second choice
        assert out[k]["output_ids"][0] == runner_up and first[k] not in out[k]["output_ids"]
    assert len(calls) == 6, "one call per step (a prefill step, then five decode steps)"
    assert [i for _, i in calls] == [[n, n] for n in range(6)], "each over the two rows that use it"
    forced = engine.generate(input_ids=prompts[0], custom_logit_processor="allow-tokens",
                             sampling_params=dict(params, custom_params={"token_id": 4242}))
    assert forced["output_ids"] == [4242] * 6, "SGLang's DeterministicLogitProcessor"
    with pytest.raises(InvalidRequest, match="serialized Python code"):
        engine.generate(input_ids=prompts[0], custom_logit_processor=DILL, sampling_params=params)


# -- a live server: off by default, a plugin by name ------------------------------------------------------
def test_off_unless_the_operator_lists_them(tiny_server):
    r = httpx.post(tiny_server.url + "/generate", timeout=60, json={
        "input_ids": [1, 2, 3], "custom_logit_processor": "ban-tokens",
        "sampling_params": {"max_new_tokens": 2, "custom_params": {"token_ids": [5]}}})
    assert r.status_code == 400 and "--logit-processors" in r.json()["error"]["message"], r.text
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "custom_logit_processor": DILL})
    assert r.status_code == 400 and "serialized Python code" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "custom_logit_processor"


@pytest.fixture(scope="module")
def plugin_server(tiny_models, tmp_path_factory):
    env = install_apart(PLUGIN, tmp_path_factory.mktemp("plugin"))
    server = ServerProcess("--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--max-total-tokens",
                           "1000", "--logit-processors", "demo-count-up", "allow-tokens", "demo-broken", env=env)
    yield server
    server.stop()


def test_a_plugin_processor_by_name_with_parameters_per_request(plugin_server):
    url = plugin_server.url
    r = httpx.post(url + "/generate", timeout=60, json={
        "input_ids": [[1, 2, 3], [4, 5, 6, 7]], "custom_logit_processor": "demo-count-up",
        "sampling_params": [dict(GREEDY, max_new_tokens=5, custom_params={"start": 100}),
                            dict(GREEDY, max_new_tokens=5, custom_params={"start": 500})]})
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [[100, 101, 102, 103, 104], [500, 501, 502, 503, 504]]
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": [9, 8, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "custom_logit_processor": "allow-tokens", "custom_params": {"token_ids": [4242]}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    for name, params, words in (("demo-count-down", {}, "not enabled on this server; enabled: allow-tokens, "
                                 "demo-broken, demo-count-up"), ("demo-count-up", {"start": -1}, "start must be")):
        r = httpx.post(url + "/generate", timeout=60, json={"input_ids": [1, 2], "custom_logit_processor": name,
                                                           "sampling_params": {"custom_params": params}})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/generate", timeout=60, json={"input_ids": [1, 2], "custom_logit_processor": "demo-broken",
                                                        "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 500, "a broken processor fails its request"
    r = httpx.post(url + "/generate", timeout=60, json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200, "and nothing else"
