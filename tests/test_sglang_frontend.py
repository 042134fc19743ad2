"""SGLang's own frontend (the real ``sglang`` package, client side, unchanged) driving radixserve: the article's
script and the rest of the frontend language, end to end against the bundled SmolLM2."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / ".venv" / "sglang-frontend"  # `make install` puts sglang (--no-deps) and its light imports here
DRIVER = Path(__file__).parent / "sglang_frontend" / "drive.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def driven(smol_server):
    assert (FRONTEND / "sglang").is_dir(), f"SGLang's frontend is not installed in {FRONTEND}: run `make install`"
    env = {**os.environ, "PYTHONPATH": str(FRONTEND)}
    proc = subprocess.run([sys.executable, str(DRIVER), smol_server.url], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_articles_script_runs_unchanged(driven):
    assert "Paris" in driven["answer"]
    assert driven["model_path"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf"), "the real path, not a chosen name"


def test_select_scores_choices_from_prompt_logprobs(driven):
    assert driven["select"] == " Paris"


def test_fork_and_run_batch(driven):
    # sampled at temperature 0.8 without a seed: a fork may draw the stop string first and end empty
    assert len(driven["facts"]) == 3 and all(isinstance(f, str) for f in driven["facts"]) and any(driven["facts"])
    assert all("\n" not in f for f in driven["facts"]), "the stop string ends each fact"
    assert len(driven["batch"]) == 2 and all(driven["batch"])


def test_structured_output_through_the_frontend(driven):
    jsonschema.validate(json.loads(driven["json"]), driven["json_schema"])
    assert re.fullmatch(r"1[0-9]{3}", driven["year"])
    assert re.fullmatch(r"[-+]?[0-9]+", driven["integer"].strip())


def test_streaming_in_sglangs_shape(driven):
    assert len(driven["stream_pieces"]) > 1 and "".join(driven["stream_pieces"]) == driven["stream_answer"]
