"""Custom logit processors, by name: SGLang's capability without running code a request sends.

SGLang takes a processor as dill-serialized Python in the request (``custom_logit_processor``), so enabling it lets
any client run any code on the server. radixserve runs only processors installed on the server as entry points,
and only those the operator lists (``--logit-processors``): a request names one and gives its parameters::

    [project.entry-points."radixserve.logit_processors"]
    my-processor = "my_package.module:MyProcessor"      # a class (or factory) called with no arguments

    POST /generate {"text": ..., "custom_logit_processor": "ban-tokens",
                    "sampling_params": {"custom_params": {"token_ids": [13, 198]}}}

This module has no torch: the scheduler imports it to check requests. The runner applies processors
(model/logit_processing.py); the built-ins are in model/token_processors.py.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.errors import InvalidRequest, did_you_mean
from radixserve.plugins import load_plugin, registered

if TYPE_CHECKING:
    import torch

GROUP = "radixserve.logit_processors"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
MAX_PARAMS_BYTES = 65536  # custom_params, JSON-encoded: it travels to the runner with the request


class LogitProcessor(Protocol):
    """A named processor. ``name`` is its registered name.

    ``check(params, vocab_size)`` (optional): validate one request's ``custom_params`` before it is queued; raise
    ValueError saying what is wrong (the client gets a 400 naming custom_params). It runs in the scheduler's
    process, which has no torch: import torch inside ``__call__``, not at the top of the module.

    ``__call__(logits, params, output_index)``: one call per step over every row that uses this processor:
    ``logits`` is float32 ``[rows, vocab]`` (the penalties already applied; a copy the processor may change in
    place), ``params[j]`` row j's custom_params, ``output_index[j]`` how many tokens row j has generated. Returns
    None (changed in place) or a tensor of the same shape. Row j's result must depend on row j alone, so that a
    request's tokens do not depend on its batch. A processor that raises fails the rows it was given (500), not
    the step; logprobs stay the model's own.
    """

    name: str

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]],
                 output_index: list[int]) -> torch.Tensor | None: ...


def available() -> list[str]:
    """Names installed (built-ins and plugins), sorted."""
    return registered(GROUP)


def load(name: str) -> LogitProcessor:
    """The processor registered as ``name``; ValueError naming the problem (unknown name, a plugin that fails to
    import or lacks ``__call__``)."""
    return load_plugin(GROUP, name, "logit processor", needs=("__call__",), see="radixserve.logit_processors")


def check_name(value: str) -> None:
    """A request's ``custom_logit_processor`` must be a name: InvalidRequest otherwise, and a clear one for
    SGLang's serialized code."""
    if NAME.fullmatch(value):
        return
    if value.lstrip().startswith("{") and "callable" in value:
        raise InvalidRequest("custom_logit_processor holds serialized Python code (SGLang's dill format); radixserve "
                             "never runs code sent in a request. Give the name of a processor the server enables "
                             "(--logit-processors; built in: allow-tokens, ban-tokens) and its parameters in "
                             "custom_params", param="custom_logit_processor")
    shown = value if len(value) <= 40 else value[:37] + "..."
    raise InvalidRequest(f"custom_logit_processor {shown!r} is not a processor name (letters, digits, - _ . :, at "
                         "most 64 characters)", param="custom_logit_processor")


class ProcessorCatalog:
    """The processors this server enables (``--logit-processors``), loaded once; checks requests against them."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.processors: dict[str, LogitProcessor] = {name: load(name) for name in names}

    def check(self, name: str | None, params: dict[str, Any] | None, vocab_size: int) -> None:
        """InvalidRequest (a 400 naming the field) unless ``name`` is None or enabled here with valid ``params``."""
        if name is None:
            return
        if not self.processors:
            raise InvalidRequest(f"custom_logit_processor {name!r}: this server runs no logit processors; its "
                                 f"operator enables named ones with --logit-processors NAME... (installed here: "
                                 f"{', '.join(available()) or 'none'})", param="custom_logit_processor")
        processor = self.processors.get(name)
        if processor is None:
            enabled = sorted(self.processors)
            raise InvalidRequest(f"custom_logit_processor {name!r} is not enabled on this server; enabled: "
                                 f"{', '.join(enabled)}{did_you_mean(name, enabled)}", param="custom_logit_processor")
        check = getattr(processor, "check", None)
        if check is None:
            return
        try:
            check(params or {}, vocab_size)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidRequest(f"custom_params for the logit processor {name!r}: {exc}",
                                 param="custom_params") from None
