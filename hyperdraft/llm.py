"""LLM: the offline API (generate, streaming, server info) over one Engine."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from hyperdraft.config import EngineArgs
from hyperdraft.detokenizer import IncrementalDetokenizer, push_all
from hyperdraft.engine.engine import Engine
from hyperdraft.engine.gc_policy import young_collections_deferred
from hyperdraft.options import RuntimeOptions
from hyperdraft.request import Request
from hyperdraft.sampling_params import SamplingParams


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    meta_info: dict = field(default_factory=dict)


@dataclass
class StreamDelta:
    index: int  # position of the request in the submitted list
    text: str  # new text since the previous delta (never part of a stop string, never half a character)
    token_ids: list[int]  # new tokens since the previous delta
    finished: bool
    finish_reason: str | None = None
    output: GenerateOutput | None = None  # the complete output, on the last delta


def meta_info(req: Request) -> dict:
    completion = len(req.output_ids)
    info = {
        "id": req.rid,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": completion,
        "cached_tokens": req.cached_tokens,
        "e2e_latency": (req.finish_time or 0.0) - req.arrival_time,
        "ttft": (req.first_token_time - req.arrival_time) if req.first_token_time else None,
        "num_retractions": req.num_retractions,
    }
    if req.spec_verify_ct:
        info["spec_verify_ct"] = req.spec_verify_ct
        info["spec_accept_length"] = completion / req.spec_verify_ct
        info["spec_draft_tokens"] = req.spec_draft_tokens
        info["spec_accepted_tokens"] = req.spec_accepted_tokens
        # the names clients of SGLang's meta_info read (its _calculate_spec_decoding_metrics); proposed counts the
        # drafts really proposed (an NGRAM lookup may find fewer than the verify width)
        info["spec_num_correct_drafts"] = req.spec_accepted_tokens
        info["spec_num_proposed_drafts"] = req.spec_draft_tokens
        info["spec_accept_rate"] = req.spec_accepted_tokens / req.spec_draft_tokens if req.spec_draft_tokens else 0.0
    if req.params.return_logprob:
        info["output_token_logprobs"] = list(req.output_logprobs)
    return info


def _left_queue(req: Request) -> bool:
    """Admitted at least once (a retracted request waits again, but keeps its outputs), or finished while waiting."""
    return req.finished or req.num_computed > 0 or bool(req.output_ids)


class LLM:
    def __init__(self, model: str | None = None, *, runtime_options: RuntimeOptions | None = None, **engine_args):
        """engine_args: EngineArgs fields (the CLI's engine flags); runtime_options: the engine's runtime switches
        (default: from the environment, see hyperdraft/options.py)."""
        if model is not None:
            engine_args["model"] = model
        self.args = EngineArgs.from_kwargs(**engine_args)
        self.engine = Engine(self.args, runtime_options)
        self.tokenizer = self.engine.tokenizer
        # The engine is not re-entrant: calls from several threads take turns, a step at a time (two threads'
        # generate() stepping it at once corrupted the batch and both hung; found by an audit). Each stream reads
        # its own requests' outputs, so interleaved steps serve everyone's requests.
        self._engine_lock = threading.RLock()

    # ---- generate -----------------------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
                 input_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = True) -> list[GenerateOutput] | GenerateOutput:
        single = isinstance(prompts, str)
        reqs = self._submit(prompts, sampling_params, input_ids)  # checked and queued before a progress bar is drawn
        outputs: list[GenerateOutput | None] = [None] * len(reqs)
        bar = self._progress(len(outputs), use_tqdm)
        try:
            for delta in self._deltas(reqs):
                if delta.finished:
                    outputs[delta.index] = delta.output
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return outputs[0] if single else outputs

    def stream(self, prompts: str | Sequence[str] | None = None,
               sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
               input_ids: Sequence[Sequence[int]] | None = None) -> Iterator[StreamDelta]:
        """Submit requests and yield per-request increments as steps produce them.

        Each request's new tokens are read from its own output (what it holds past what was yielded), not from the
        step's outputs: another stream or a generate() interleaved with this one steps the same engine, and the
        tokens its steps give these requests must reach these detokenizers too."""
        yield from self._deltas(self._submit(prompts, sampling_params, input_ids))

    def _deltas(self, reqs: list[Request]) -> Iterator[StreamDelta]:
        """Each step reads the requests that have left the engine's queue (`live`); the rest wait in `queued`, in
        submission order, which is the order the scheduler admits them in (FCFS). Reading every unfinished request
        each step cost ~0.2 us a queued request: ~18 ms a step for a 10^5-prompt generate (an audit's measurement)."""
        detoks = [self._detokenizer(req) for req in reqs]
        yielded = [0] * len(reqs)  # tokens of each request's output already in a delta
        queued, live = deque(range(len(reqs))), []
        try:
            with young_collections_deferred():  # engine/gc_policy.py: the GC's young walks off the step path
                while live or queued:
                    with self._engine_lock:  # the step and what it gave these requests, read before another step
                        self.engine.step()
                        while queued and _left_queue(reqs[queued[0]]):
                            live.append(queued.popleft())
                        moved = [i for i in live if reqs[i].finished or len(reqs[i].output_ids) > yielded[i]]
                        news = [reqs[i].output_ids[yielded[i]:] for i in moved]
                        finals = [reqs[i].finished for i in moved]
                        shown = [reqs[i].text_ids(new) for i, new in zip(moved, news)]  # as of that step, too
                    pushes = [(detoks[i], ids, final) for i, ids, final in zip(moved, shown, finals)]
                    texts = push_all(pushes)
                    for i, new in zip(moved, news):
                        yielded[i] += len(new)
                    done = {i for i, final in zip(moved, finals) if final}
                    live = [i for i in live if i not in done]
                    for i, new, final, text in zip(moved, news, finals, texts):
                        yield self._delta(i, reqs[i], new, text, final, detoks[i])
        finally:
            if live or queued:  # the consumer stopped early: do not leave orphans holding KV or queued
                with self._engine_lock:
                    self.engine.abort_many([reqs[i].rid for i in (*live, *queued)])

    # ---- chat ---------------------------------------------------------------------------------------------------
    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
             use_tqdm: bool = True, **template_kwargs) -> list[GenerateOutput] | GenerateOutput:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"} dicts) or to a batch
        of them (a list of such lists): one GenerateOutput, or a list. Extra keyword arguments go to the chat
        template (e.g. tools=...)."""
        batch = bool(messages) and all(isinstance(m, (list, tuple)) for m in messages)
        ids = [self.apply_chat_template(conv, **template_kwargs) for conv in (messages if batch else [messages])]
        outputs = self.generate(input_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)
        return outputs if batch else outputs[0]

    def apply_chat_template(self, messages: Sequence[dict], **template_kwargs) -> list[int]:
        """Token ids of one conversation rendered by the tokenizer's chat template, ending with the generation prompt."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, but skip_tokenizer_init=True")
        if not self.tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template, so chat() cannot format messages; "
                             "use generate() with a prompt you format yourself")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template already wrote any BOS

    # ---- internals ----------------------------------------------------------------------------------------------
    def _submit(self, prompts, sampling_params, input_ids) -> list[Request]:
        if (prompts is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompts or input_ids")
        if prompts is not None:
            items = [prompts] if isinstance(prompts, str) else list(prompts) if isinstance(prompts, (list, tuple)) \
                else None
            if items is None or not all(isinstance(p, str) for p in items):
                raise ValueError("prompts must be a string or a list of strings (token ids go in input_ids)")
            kw = [dict(prompt=p) for p in items]
        else:
            if not all(isinstance(x, (list, tuple)) for x in input_ids):
                raise ValueError("input_ids must be a list of token-id lists")
            kw = [dict(input_ids=list(ids)) for ids in input_ids]
        params = self._params(sampling_params, len(kw))
        # Validate everything before queueing anything, so one bad request leaves the others unsubmitted and intact.
        for k, p in zip(kw, params):
            if "input_ids" not in k:
                k["input_ids"] = self.engine.tokenize(k.pop("prompt"))
            self.engine.check_request(p, k["input_ids"])
        with self._engine_lock:
            return [self.engine.add_request(params=p, **k) for k, p in zip(kw, params)]

    @staticmethod
    def _params(sampling_params, n: int) -> list[SamplingParams]:
        """One SamplingParams per request. A dict (or a list of them) is read as SGLang's offline Engine.generate
        takes its sampling_params: SamplingParams field names, unknown ones an error."""
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, (SamplingParams, dict)):
            sampling_params = [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)) or not all(isinstance(p, (SamplingParams, dict))
                                                                     for p in sampling_params):
            raise ValueError("sampling_params must be a SamplingParams or a dict of its fields, or a list of them, "
                             f"got {type(sampling_params).__name__}")
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else p for p in sampling_params]
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} requests")
        return params

    @staticmethod
    def _progress(n: int, use_tqdm: bool):
        if not use_tqdm or n < 2:
            return None
        from tqdm import tqdm

        return tqdm(total=n, desc="generate", unit="req")

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, req.params.stop or [], req.params.skip_special_tokens,
                                      keep_stop=req.params.no_stop_trim, prompt_ids=req.prompt_ids)

    def _delta(self, index: int, req: Request, new_ids: list[int], text: str, final: bool,
               detok: IncrementalDetokenizer) -> StreamDelta:
        """text: what detok's push of new_ids gave (pushed for the whole step at once: detokenizer.push_all); final:
        whether the request had finished at that push (it may have finished since, in a step of another caller)."""
        output = None
        if final:
            info = meta_info(req)
            if self.engine.spec is not None and self.engine.spec.simulate_accept_rate is not None:
                info["simulated_accept_rate"] = self.engine.spec.simulate_accept_rate  # lossy benchmark mode
            output = GenerateOutput(detok.text, list(req.output_ids), req.finish_reason, info)
        return StreamDelta(index, text, list(new_ids), final, req.finish_reason if final else None, output)

    # ---- server-style introspection -----------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Empty the prefix cache (only while nothing runs) -> whether it did."""
        with self._engine_lock:
            return self.engine.flush_cache()

    def get_server_info(self) -> dict:
        with self._engine_lock:
            return {**self.engine.server_args(), "internal_states": [self.engine.internal_state()]}

    def shutdown(self) -> None:
        """Abort what is left and release the models and KV pools (GPU memory included). The LLM is unusable after."""
        if self.engine is None:
            return
        self.engine.abort_many([req.rid for req in (*self.engine.scheduler.waiting, *self.engine.scheduler.running)])
        self.engine.close()  # a tensor-parallel group's other ranks stop with it
        self.engine = None
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
