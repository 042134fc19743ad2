"""``@sgl.function``: a Python function of a state ``s`` that becomes a program you can run, stream and batch."""
from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from radixserve.lang.defaults import resolve_backend, resolve_template
from radixserve.lang.executor import Executor, RunContext
from radixserve.lang.sampling import SamplingDefaults
from radixserve.lang.state import ProgramState


class Function:
    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@sgl.function {func.__name__}() must take the state as its first argument, "
                            "e.g. def qa(s, question): ...")
        self.func = func
        self.arg_names = params[1:]
        self.bound = dict(bound or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some program arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__}() has no argument(s) {unknown}; its arguments are {self.arg_names}")
        return Function(self.func, {**self.bound, **kwargs})

    def run(self, *args: Any, backend: Any = None, stream: bool = False, max_new_tokens: int = 128,
            temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
            min_p: float | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
            ignore_eos: bool | None = None, frequency_penalty: float | None = None,
            presence_penalty: float | None = None, return_logprob: bool | None = None,
            logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
            return_text_in_logprobs: bool | None = None, **kwargs: Any) -> ProgramState:
        """Run the program once. The keyword-only sampling parameters are every gen's defaults (a gen's own
        arguments win); every other argument goes to the program.

        Errors do not raise here: ``state.error()`` returns them and ``state[...]``/``state.text()`` re-raise.
        With ``stream=True`` this returns at once and the program runs in a background thread.
        """
        defaults = SamplingDefaults.from_kwargs({
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "min_p": min_p, "stop": stop, "stop_token_ids": stop_token_ids, "ignore_eos": ignore_eos,
            "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
            "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs})
        return self.start(args, kwargs, self.context(backend, defaults, stream))

    __call__ = run

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple[Any, ...]], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  **sampling: Any) -> list[ProgramState]:
        """Run the program once per argument set, concurrently; the states come back in input order.

        Before that, the prompt text every member shares up to its first model call is prefilled once, so the
        radix cache holds it and each member computes only its own part. Finding that text runs the program
        function once more per member against a recording state that calls no model.
        """
        from radixserve.lang.batch import run_batch

        ctx = self.context(backend, SamplingDefaults.from_kwargs(sampling), stream=False)
        return run_batch(self, [self.as_kwargs(b) for b in batch_kwargs], ctx, num_threads, progress_bar)

    def context(self, backend: Any, defaults: SamplingDefaults, stream: bool) -> RunContext:
        resolved = resolve_backend(backend)
        return RunContext(resolved, resolve_template(resolved), defaults, stream)

    def as_kwargs(self, args: dict[str, Any] | tuple[Any, ...] | list[Any]) -> dict[str, Any]:
        if isinstance(args, dict):
            return dict(args)
        if isinstance(args, (tuple, list)):
            if len(args) > len(self.arg_names):
                raise TypeError(f"{self.__name__}() takes {len(self.arg_names)} arguments "
                                f"{self.arg_names}, got {len(args)}: {args!r}")
            return dict(zip(self.arg_names, args))
        raise TypeError(f"run_batch takes a list of dicts (or tuples) of program arguments, got {type(args).__name__}")

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: RunContext) -> ProgramState:
        """Run the program function against a fresh state (in a background thread when streaming)."""
        call_kwargs = {**self.bound, **kwargs}
        state = ProgramState(Executor(ctx))
        try:  # a missing or unknown argument is the caller's mistake: raise it here, not later from a state
            inspect.signature(self.func).bind(state, *args, **call_kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.__name__}(): {exc}") from None
        if ctx.stream:
            threading.Thread(target=self._body, args=(state, args, call_kwargs), name=f"sgl-{self.__name__}").start()
        else:
            self._body(state, args, call_kwargs)
            state.sync()
        return state

    def _body(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ex = state._ex
        ex.program_thread = threading.get_ident()
        try:
            self.func(state, *args, **kwargs)
        except BaseException as exc:
            ex.fail(exc)
            if not isinstance(exc, Exception):  # Ctrl-C and exit still stop the caller
                raise
        finally:
            ex.end()
