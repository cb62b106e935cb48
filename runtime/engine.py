"""Generation over one loaded bundle: sessions and KV buffers for one sequence at a time.

An Engine has one owner: one thread drives it at a time, and it takes no lock. A second
generation while one is open is refused at once (it would share the KV buffers); to share a
bundle between threads, requests or event loops, use runtime.api.Model, whose scheduler
(runtime/scheduler.py) admits, queues and drives every generation from its one worker.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from edge_spec.budget import check_parallel, plan_bundle
from edge_spec.commit import commit, stop_prefix_len
from edge_spec.drafters import available_drafters, drafter_spec
from edge_spec.manifest import BundleError
from edge_spec.params import SettingError, shown
from runtime.drafters.base import Drafter, parts, use_clock
from runtime.drafters.suffix import serve_client
from runtime.batch import batch_round, batched_target
from runtime.calibration import calibrate, calibrated
from runtime.gamma import CostModel, GammaConfig
from runtime.loader import LoadConfig, Loader
from runtime.loop import Step, decode_steps
from runtime.policy import RoundPolicy
from runtime.requests import GenerateConfig, Speculation, check_messages, check_prompt_text
from runtime.sessions import ProviderChoice
from runtime.stats import Stats, summarize
from runtime.tokenizer import StreamDecoder


class PromptTooLongError(ValueError):
    pass


def check_token_ids(ids, vocab: int) -> None:
    """Every id an int in [0, vocab): ids past the tokenizer would index past embeddings."""
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"token ids must be integers, got {shown(i)}")
        if not 0 <= i < vocab:
            raise ValueError(f"token id {shown(i)} is outside the vocabulary [0, {vocab})")


class Prompt(tuple):
    """Token ids checked, as the Prompt is built, for `limits` (vocabulary, max context): not
    empty, every id an int in [0, vocab), room left for a token. No Prompt exists unchecked, so
    Engine.stream and Model.submit take one without checking it again."""

    def __new__(cls, ids: Iterable[int], limits: tuple[int, int]):
        vocab, max_context = limits
        for name, value in (("vocab", vocab), ("max_context", max_context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a Prompt's {name} limit must be an integer >= 1, got {value!r}")
        prompt = super().__new__(cls, ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        check_token_ids(prompt, vocab)
        if len(prompt) >= max_context:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens but the bundle's max context is {max_context}; "
                "shorten the prompt or re-export with a larger --max-context"
            )
        object.__setattr__(prompt, "_limits", (vocab, max_context))
        return prompt

    @property
    def limits(self) -> tuple[int, int]:
        return self._limits

    def __setattr__(self, name, value):
        raise AttributeError("a Prompt is checked once, as it is built, and cannot be changed")


def check_prompt(ids: Iterable[int], vocab: int, max_context: int) -> Prompt:
    """The one prompt check (Prompt's): a Prompt built for these limits passes as it is."""
    if isinstance(ids, Prompt) and ids.limits == (vocab, max_context):
        return ids
    if isinstance(ids, (str, bytes)):
        raise ValueError("prompt ids must be a list of token ids, not text (pass the text as prompt=)")
    try:
        return Prompt(ids, (vocab, max_context))
    except TypeError:
        raise ValueError(f"prompt ids must be a list of token ids, got {shown(ids)}") from None


SUFFIX_CACHES = ("per-client", "shared")
# A prefill chunk beside running sequences: at least this many tokens (a smaller pass costs
# about as much as a 1-token one), at most ModelRunner.prefill's own chunk.
PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX = 8, 256


@dataclass(frozen=True)
class EngineConfig(LoadConfig):
    """What the Loader reads (LoadConfig: providers, drafter, budget, ...) and how the Engine
    chooses γ from it."""

    gamma: int | None = None  # None: adaptive
    # The adaptive policy's other knobs (probes, loss ledger, α decay and prior); its fixed and
    # max_gamma stay at their defaults: gamma and max_gamma set them (gamma_for).
    gamma_config: GammaConfig = GammaConfig()
    calibrate: bool = True  # time target and draft passes at load, to seed the cost model
    # What the suffix cache lets a request copy from: "per-client", only its own client's earlier
    # text (GenerateConfig.client); "shared", every earlier request's (its drafts then reveal them).
    suffix_cache: str = "per-client"
    # Batched decoding: a new sequence's prompt enters beside running ones in chunks priced at
    # most this many milliseconds each (one per step), so a running stream's gap per token grows
    # by at most that much; None prefills a prompt whole before the next step (the batch waits).
    prefill_stall_ms: float | None = 50.0

    def __post_init__(self):
        if isinstance(self.gamma, int) and not isinstance(self.gamma, bool) and isinstance(self.max_gamma, int) and self.gamma > self.max_gamma:
            # A fixed γ above the cap raises the cap, here once: the memory plan then counts the blocks the engine runs.
            object.__setattr__(self, "max_gamma", self.gamma)
        super().__post_init__()
        stall = self.prefill_stall_ms
        if stall is not None and (isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 < stall < float("inf")):
            raise ValueError(f"prefill_stall_ms must be a number of milliseconds above 0, or None, got {shown(stall)}")
        if self.suffix_cache not in SUFFIX_CACHES:
            raise ValueError(f"suffix_cache must be one of {', '.join(SUFFIX_CACHES)}, got {shown(self.suffix_cache)}")
        if not isinstance(self.gamma_config, GammaConfig):
            raise ValueError(f"gamma_config must be a GammaConfig, got {shown(self.gamma_config)}")
        default = GammaConfig()
        if (self.gamma_config.fixed, self.gamma_config.max_gamma) != (default.fixed, default.max_gamma):
            raise ValueError("set γ with EngineConfig(gamma=..., max_gamma=...), not in gamma_config "
                             f"(got gamma_config fixed={self.gamma_config.fixed}, max_gamma={self.gamma_config.max_gamma})")
        dataclasses.replace(self.gamma_config, fixed=self.gamma, max_gamma=self.max_gamma)  # raises ValueError on a γ it cannot run

    def gamma_for(self, cap: int | None = None) -> GammaConfig:
        """The γ config a generation runs with: gamma_config with this config's γ, both capped at
        `cap` (a request's max_gamma; None: max_gamma)."""
        cap = self.max_gamma if cap is None else cap
        fixed = None if self.gamma is None else min(self.gamma, cap)
        return dataclasses.replace(self.gamma_config, fixed=fixed, max_gamma=cap)


@dataclass
class GenerationResult:
    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    stop_reason: str  # eos | stop | length | context | cancelled
    timings: dict  # Stats.timings(), plus queue_s from runtime.api
    stats: Stats
    rounds: tuple[tuple[int, int], ...] = ()  # (drafted, accepted) per target pass, in order
    steps: tuple[Step, ...] = ()  # what the loop yielded, one per target pass, in order
    speculation: dict = field(default_factory=dict)  # what decoded it: drafter, gamma ("auto" or N), max_gamma


class SequenceText:
    """One sequence's output as its steps arrive: the tokens kept (max_new_tokens, the context,
    EOS), the text, stop strings, text held back while it may still start one, the stop reason
    (cancelled: the Event was set), and at the end the result."""

    def __init__(self, engine: "Engine", prompt_ids: list[int], config: GenerateConfig, cancel: threading.Event | None, used: dict):
        self.engine, self.prompt_ids, self.config, self.cancel, self.used = engine, list(prompt_ids), config, cancel, used
        self.decoder = StreamDecoder(engine.tokenizer)
        self.generated: list[int] = []
        self.steps: list[Step] = []
        self.text = ""
        self.shown = 0  # characters of text streamed: the rest may start a stop string
        self.stop_reason: str | None = None
        self.began = time.perf_counter()
        self.first_step_at: float | None = None

    def add(self, step: Step) -> str:
        """Keep what the step commits; returns the text now safe to show ("" if none)."""
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
        self.steps.append(step)
        config = self.config
        # A round may commit tokens past where plain decoding would have stopped.
        room = self.engine.target.cache.max_context - len(self.prompt_ids) - len(self.generated)
        kept = commit(step.tokens, len(self.generated), config.max_new_tokens, room, self.engine.tokenizer.eos_token_ids,
                      self.text, config.stop, self.decoder.push)
        self.generated += kept.tokens
        self.text, self.stop_reason = kept.text, kept.stop_reason
        piece = ""
        if kept.piece:
            safe = len(self.text) - stop_prefix_len(self.text, config.stop)
            if safe > self.shown:
                piece, self.shown = self.text[self.shown : safe], safe
        if self.stop_reason is None and self.cancel is not None and self.cancel.is_set():
            self.stop_reason = "cancelled"
        return piece

    def finish(self, stop_reason: str | None = None) -> tuple[str, GenerationResult]:
        """The held-back tail that did not become a stop string, and the result; stop_reason:
        why it ends, where no step said (cancelled before its next pass)."""
        self.stop_reason = self.stop_reason or stop_reason
        tail = self.text[self.shown :]
        self.shown = len(self.text)
        result = self.engine._result(self.text, self.prompt_ids, self.generated, self.stop_reason, self.steps, self.began,
                                     self.first_step_at, time.perf_counter())
        result.speculation = self.used
        return tail, result


@dataclass(eq=False)
class SlotSequence:
    """A sequence decoding in one KV slot of Engine.batched (Engine.slot_sequence): one row of
    the batched plain passes, or, while it holds the Engine's drafter, speculative rounds of its
    own where the policy prices them above its row in the batch (Engine.advance_slots)."""

    slot: int
    prompt_ids: list[int]
    config: GenerateConfig
    rng: np.random.Generator
    out: SequenceText
    kind: str = "none"  # the drafter it speculates with when it holds the Engine's ("none": plain only)
    tokens: np.ndarray | None = None  # committed, the last one pending (no row yet); None until prefilled
    prefilled: int | None = None  # prompt rows in its slot so far (None: not begun); chunked beside running sequences
    ended: bool = False


class Engine:
    """Generation over what a Loader opened; the Loader keeps the bundle, sessions and caches.
    Single-owner: one thread drives it at a time (runtime.api.Model shares one between threads)."""

    def __init__(self, bundle_path: str | Path, config: EngineConfig = EngineConfig(),
                 session_hook: Callable[[str, object], object] | None = None):
        """session_hook: for measurement tools (benchmarks/bench/timing.py), None in the product
        (runtime/loader.py says what it is called with and must return)."""
        self.config = config
        self.loader = Loader(bundle_path, config, session_hook)
        self.bundle = self.loader.bundle
        self.tokenizer = self.loader.tokenizer
        self.target = self.loader.runner("target")
        self.drafter = self.loader.drafter(config.drafter)
        self._drafters = {config.drafter: self.drafter}
        self._plans_fit: dict[str, bool] = {}  # by drafter kind, with config.memory_budget
        self.costs = CostModel()
        self.policy = RoundPolicy(self.costs)  # α per drafter and γ config for the engine's life
        self._generating = False  # a stream is open: its sequence holds the KV buffers
        self._batch = None  # runtime.batch.BatchedTarget, made by the first batched generation
        self._drafting: SlotSequence | None = None  # the slot sequence holding the drafter (advance_slots)
        self._drafter_of_slot: Drafter | None = None
        if config.calibrate and self.drafter is not None:
            self.calibrate()

    # -- what was loaded -------------------------------------------------------------------

    @property
    def provider_choices(self) -> dict[str, ProviderChoice]:
        return self.loader.provider_choices

    @property
    def provider(self) -> str:
        return self.provider_choices["target"].provider

    @property
    def draft_provider(self) -> str:
        return self.provider_choices["draft"].provider

    @property
    def warnings(self) -> list[str]:
        return self.loader.warnings

    def provider_report(self) -> dict:
        return self.loader.provider_report()

    def provider_line(self) -> str:
        return self.loader.provider_line()

    def use_drafter(self, kind: str, gamma: int | None = None) -> None:
        """Switch drafter (and γ policy) without reloading: sessions and buffers are reused."""
        drafter_spec(kind)  # an unknown name fails before anything changes
        self._idle("switch drafters")
        self.config = dataclasses.replace(self.config, drafter=kind, gamma=gamma)
        if kind not in self._drafters:
            self._drafters[kind] = self.loader.drafter(kind)
        self.drafter = self._drafters[kind]
        if self.config.calibrate and not calibrated(self.costs, self.drafter):
            self.calibrate()

    def available_drafters(self) -> tuple[str, ...]:
        """The drafters a request may choose on this bundle: those whose role it has (edge_spec/drafters.py)."""
        return available_drafters(self.bundle.manifest.models)

    def check_speculation(self, speculation: Speculation | None) -> None:
        """SettingError unless this bundle has the drafter and the γ cap is within the Engine's max_gamma
        (start-up calibration timed target passes up to that)."""
        if speculation is None:
            return
        available = self.available_drafters()
        if speculation.drafter is not None and speculation.drafter not in available:
            raise SettingError("speculation.drafter", f"drafter {shown(speculation.drafter)} is not one this bundle has; "
                                                      f"choose from {', '.join(available)}")
        if speculation.max_gamma is not None and speculation.max_gamma > self.config.max_gamma:
            raise SettingError("speculation.max_gamma", f"speculation.max_gamma must be 1..{self.config.max_gamma} (the "
                                                        f"engine's max_gamma), got {speculation.max_gamma}")
        budget = self.config.memory_budget
        if speculation.drafter is not None and budget is not None and not self._fits_budget(speculation.drafter, budget):
            raise SettingError("speculation.drafter", f"drafter {speculation.drafter!r} would load more than the memory "
                                                      f"budget of {budget} bytes allows; choose another")

    def _fits_budget(self, kind: str, budget: int) -> bool:
        """The memory plan of the load's check (edge_spec.budget) for a drafter a request chooses:
        a request cannot load a draft model the budget left out."""
        if kind not in self._plans_fit:
            plan = plan_bundle(self.bundle.manifest, self.bundle.path, kind, budget, self.config.max_gamma)
            self._plans_fit[kind] = plan.fits
        return self._plans_fit[kind]

    def _request_drafter(self, speculation: Speculation | None) -> tuple[str, Drafter | None, GammaConfig]:
        """The drafter and γ config one generation runs with (called as it starts); a
        drafter first chosen by a request is made and calibrated here, once."""
        kind = speculation.drafter if speculation is not None and speculation.drafter is not None else self.config.drafter
        if kind not in self._drafters:
            self._drafters[kind] = self.loader.drafter(kind)
        drafter = self._drafters[kind]
        if self.config.calibrate and not calibrated(self.costs, drafter):
            calibrate(self.target, drafter, self.costs, self.bundle.manifest.tokenizer.eos_token_ids[0], self.config.max_gamma)
        return kind, drafter, self.config.gamma_for(None if speculation is None else speculation.max_gamma)

    def _serve(self, drafter: Drafter | None, client: str | None) -> None:
        """The drafter's next sequence is `client`'s: a per-client suffix cache copies from its text only."""
        serve_client(drafter, client if self.config.suffix_cache == "per-client" else None)

    def forget(self) -> None:
        """Drop what every drafter keeps from earlier sequences (the suffix cache)."""
        self._idle("forget")
        for drafter in self._drafters.values():
            for part in parts(drafter):
                part.forget()

    def calibrate(self, repeats: int = 2) -> None:
        """Seed the cost model with this device's pass times (runtime/calibration.py)."""
        eos = self.bundle.manifest.tokenizer.eos_token_ids[0]
        calibrate(self.target, self.drafter, self.costs, eos, self.config.max_gamma, repeats)

    # -- generation ------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of a raw prompt or of chat messages. Special-token strings in message content
        are always text; in a raw prompt they are control tokens unless parse_special=False."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt or messages")
        if messages is not None:
            return self.tokenizer.encode_chat(check_messages(messages))
        return self.tokenizer.encode(check_prompt_text(prompt), parse_special=parse_special)

    def check_prompt(self, prompt_ids: Iterable[int]) -> Prompt:
        """ValueError (empty, or ids outside the vocabulary) or PromptTooLongError."""
        return check_prompt(prompt_ids, self.bundle.manifest.tokenizer.n_real_tokens, self.target.cache.max_context)

    def stream(
        self, prompt_ids: list[int], config: GenerateConfig = GenerateConfig(), speculative: bool = True,
        cancel: threading.Event | None = None,
    ) -> Iterator[tuple[str, GenerationResult | None]]:
        """Yields (text piece, None) as tokens are accepted, then ("", result) once; the pieces
        add up to result.text (text that may still start a stop string is held back until it
        is known not to). prompt_ids: a list, or a Prompt from check_prompt (not checked again).
        speculative=False decodes plainly with the same sessions (for comparisons).
        cancel: an Event another thread may set; generation then stops after the current
        target pass and the result's stop_reason is "cancelled"."""
        prompt_ids = self.check_prompt(prompt_ids)
        self.check_speculation(config.speculation)
        self._idle("generate")
        self._generating = True
        try:
            if speculative:
                kind, drafter, gamma = self._request_drafter(config.speculation)
                self._serve(drafter, config.client)
            else:
                kind, drafter, gamma = "none", None, dataclasses.replace(self.config.gamma_for(), fixed=None)
            yield from self._stream_owned(list(prompt_ids), config, drafter, cancel, gamma, kind)
        finally:
            self._generating = False

    def _idle(self, doing: str) -> None:
        """The single-owner check (not a lock: it refuses, it never waits). A generation open on
        this Engine holds its KV buffers, so nothing else may run until it ends."""
        if self._generating:
            raise RuntimeError(f"this Engine is already generating, so it cannot {doing} now: it decodes one sequence "
                               "at a time for one owner; finish or close() that stream first, or share the bundle "
                               "through runtime.api.Model, which queues requests")

    def _stream_owned(self, prompt_ids: list[int], config: GenerateConfig, drafter: Drafter | None, cancel: threading.Event | None = None,
                       gamma: GammaConfig | None = None, kind: str | None = None):
        rng = np.random.default_rng(config.sampling.seed)
        gamma = gamma or self.config.gamma_for()
        used = {"drafter": kind or ("none" if drafter is None else self.config.drafter),
                "gamma": "auto" if gamma.fixed is None else gamma.fixed, "max_gamma": gamma.max_gamma}
        policy = self.policy.start(drafter, config.max_new_tokens, gamma)
        out = SequenceText(self, prompt_ids, config, cancel, used)
        for step in decode_steps(self.target, drafter, prompt_ids, config.sampling, rng, policy):
            piece = out.add(step)
            if piece:
                yield piece, None
            if out.stop_reason is not None:
                break
        tail, result = out.finish()
        if tail:
            yield tail, None
        yield "", result

    def generate(
        self, prompt_ids: list[int], config: GenerateConfig = GenerateConfig(), speculative: bool = True,
        cancel: threading.Event | None = None,
    ) -> GenerationResult:
        result = None
        for _, result in self.stream(prompt_ids, config, speculative, cancel):
            pass
        return result

    def batched(self, n: int):
        """The target over at least n KV slots of its own (runtime/batch.py), made once and
        remade larger when asked for more; its sessions are the target's."""
        if self._batch is None or len(self._batch.slots) < n:
            check_parallel(self.bundle.manifest, self.bundle.path, self.config.drafter, self.config.memory_budget, n, self.config.max_gamma)
            self._batch = None  # the old slots go before the new ones are allocated
            self._batch = batched_target(self.loader, n)
        return self._batch

    def free_slot(self, prompt_ids, taken: set[int], n: int) -> int:
        """Of KV slots 0..n-1 not in `taken`, the one whose rows share the longest start with the
        prompt (an earlier turn of the same chat), else the lowest, which keeps a batch compact."""
        caches = self.batched(n).slots.caches
        free = [slot for slot in range(n) if slot not in taken]

        def shared(slot: int) -> int:
            rows = caches[slot].row_tokens[: caches[slot].kv_len]
            m = min(len(rows), len(prompt_ids) - 1)
            same = np.flatnonzero(rows[:m] != np.asarray(prompt_ids[:m], dtype=np.int64))
            return int(same[0]) if same.size else m

        return max(free, key=lambda slot: (shared(slot), -slot))

    def slot_sequence(self, slot: int, prompt_ids, config: GenerateConfig, cancel: threading.Event | None = None) -> "SlotSequence":
        """A sequence that decodes in KV slot `slot` of `batched`, advanced with others by
        `advance_slots`; nothing runs until then. ValueError for a block-stable Engine. A
        request whose drafter drafts into the target's own KV (layer-skip) decodes plainly
        here, and its result says so (speculation["drafter"] "none", "asked" the drafter)."""
        if self.config.block_stable:
            raise ValueError("batched decoding is not block-stable: a batched pass computes one row per sequence, where "
                             "block-stable passes compute two (docs/batching.md)")
        prompt_ids = self.check_prompt(prompt_ids)
        self.check_speculation(config.speculation)
        speculation = config.speculation
        kind = speculation.drafter if speculation is not None and speculation.drafter is not None else self.config.drafter
        gamma = self.config.gamma_for(None if speculation is None else speculation.max_gamma)
        used = {"drafter": kind, "gamma": "auto" if gamma.fixed is None else gamma.fixed, "max_gamma": gamma.max_gamma, "batched": True}
        if kind != "none" and drafter_spec(kind).draft_role(self.bundle.manifest.default_draft) == "layer_skip":
            used = {"drafter": "none", "gamma": 0, "max_gamma": 0, "batched": True, "asked": kind}
            kind = "none"
        elif kind == "none":
            used.update(gamma=0, max_gamma=0)
        return SlotSequence(slot, list(prompt_ids), config, np.random.default_rng(config.sampling.seed),
                            SequenceText(self, prompt_ids, config, cancel, used), kind)

    def end_slot(self, sequence: "SlotSequence", stop_reason: str) -> tuple[str, GenerationResult]:
        """End a slot sequence between passes (cancelled): its held-back tail and result; the
        drafter it held is free for the next."""
        sequence.ended = True
        if self._drafting is sequence:
            self._drafting = None
        return sequence.out.finish(stop_reason=stop_reason)

    def _drafting_in(self, sequences: list["SlotSequence"]) -> "SlotSequence | None":
        """The sequence of this pass that holds the drafter: the one that holds it, or, when the
        drafter is free, the first that speculates (its drafter and policy start on its tokens).
        One at a time, since the Engine has one of each drafter and one RoundPolicy sequence."""
        if self._drafting is not None and self._drafting.ended:  # ended outside a pass (failed, withdrawn)
            self._drafting = None
        while self._drafting is None:
            waiting = [s for s in sequences if s.kind != "none"]
            if not waiting:
                return None
            sequence = waiting[0]
            _, drafter, gamma = self._request_drafter(sequence.config.speculation)
            if drafter is None:  # a drafter kind that copies nothing on this bundle
                sequence.kind = "none"
                continue
            self.policy.start(drafter, sequence.config.max_new_tokens, gamma)
            use_clock(drafter, time.perf_counter)
            self._serve(drafter, sequence.config.client)
            # Not fed now, while the batch waits: its first round catches up, priced as replay
            # (speculation_pays), so a draft model that will not pay beside the batch costs nothing.
            drafter.reset(sequence.tokens[:-1], prefill=False)
            self._drafting, self._drafter_of_slot = sequence, drafter
        return self._drafting if self._drafting in sequences else None

    def advance_slots(self, sequences: list["SlotSequence"]) -> list[list[tuple[str, GenerationResult | None]]]:
        """One step of every sequence (runtime/batch.py's batch_round), those prefilled alone
        first, the first time: the one holding the drafter plays a speculative round of its own
        where that pays, the rest share one batched target pass. Returns per sequence the (text
        piece, None) items to stream and, when it ended, ("", result) last; an ended sequence is
        out of later passes."""
        target = self.batched(max(s.slot for s in sequences) + 1)
        self._prefill_some(target, sequences)
        ready = [s for s in sequences if s.tokens is not None]
        steps = batch_round(target, ready, self._drafting_in(ready), self._drafter_of_slot, self.policy, self.costs) if ready else []
        stepped = dict(zip(map(id, ready), steps))
        items = []
        for sequence in sequences:
            if id(sequence) not in stepped:  # its prompt still entering, a chunk a step
                items.append([])
                continue
            piece = sequence.out.add(stepped[id(sequence)])
            out = [(piece, None)] if piece else []
            if sequence.out.stop_reason is not None:
                tail, result = self.end_slot(sequence, sequence.out.stop_reason)
                out += ([(tail, None)] if tail else []) + [("", result)]
            items.append(out)
        return items

    def _prefill_some(self, target, sequences: list["SlotSequence"]) -> None:
        """Prompts not yet in their slots: whole when no sequence is decoding, else one chunk of
        the first, sized by the cost model to cost at most prefill_stall_ms, so the running
        sequences step after it (a long prompt no longer stalls every stream for its length)."""
        decoding = any(s.tokens is not None for s in sequences)
        for sequence in [s for s in sequences if s.tokens is None]:
            runner = target.runner(sequence.slot)
            if sequence.prefilled is None:  # rows the slot holds of this prompt's start (an earlier turn of a chat) are kept
                sequence.prefilled = runner.cache.rollback_to_prefix(sequence.prompt_ids[:-1])
            rest = sequence.prompt_ids[sequence.prefilled:-1]
            if decoding and self.config.prefill_stall_ms is not None:
                rest = rest[: self.costs.prefill_chunk(self.config.prefill_stall_ms / 1000, PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX)]
            if rest:
                began = time.perf_counter()
                runner.prefill(rest)
                if decoding:
                    self.costs.record_prefill(len(rest), time.perf_counter() - began)
                sequence.prefilled += len(rest)
            if sequence.prefilled == len(sequence.prompt_ids) - 1:
                sequence.tokens = np.asarray(sequence.prompt_ids, dtype=np.int64)
            if decoding and self.config.prefill_stall_ms is not None:
                return  # one chunk a step beside running sequences

    def generate_batch(self, prompts: list[list[int]], config: GenerateConfig | list[GenerateConfig] = GenerateConfig()) -> list[GenerationResult]:
        """Several prompts decoded at once (advance_slots): one target pass feeds every unfinished
        sequence its next token (runtime/batch.py), each sequence with its own settings and
        seed, so each one's tokens are distributed as its solo decoding's (token for token the
        same where the batched row equals the 1-row pass's; docs/batching.md).
        config: one for all, or one per prompt; a config without `speculation` decodes plainly,
        one that names a drafter speculates while it holds the Engine's drafter and that pays."""
        configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(prompts)
        if len(configs) != len(prompts) or not prompts:
            raise ValueError(f"generate_batch takes one or more prompts and one config or one per prompt, got {len(prompts)} and {len(configs)}")
        sequences = [self.slot_sequence(slot, p, dataclasses.replace(c, speculation=c.speculation or Speculation("none")))
                     for slot, (p, c) in enumerate(zip(prompts, configs))]
        self._idle("generate")
        self._generating = True
        try:
            results: dict[int, GenerationResult] = {}
            while len(results) < len(sequences):
                running = [s for s in sequences if not s.ended]
                for sequence, items in zip(running, self.advance_slots(running)):
                    if sequence.ended:
                        results[sequence.slot] = items[-1][1]
            return [results[s.slot] for s in sequences]
        finally:
            self._drafting = None
            self._generating = False

    def _result(self, text, prompt_ids, generated, stop_reason, steps: list[Step], began, first_step_at, ended) -> GenerationResult:
        cost_ratio = {name: self.costs.cost_ratio(name) for name in self.costs.draft_step}
        stats = summarize(steps, len(generated), cost_ratio, began, first_step_at, ended)
        rounds = tuple((s.n_drafted, s.n_accepted) for s in steps)
        return GenerationResult(text, list(prompt_ids), generated, stop_reason or "length", stats.timings(), stats, rounds, tuple(steps))


__all__ = ["Engine", "EngineConfig", "GenerateConfig", "Speculation", "GenerationResult", "BundleError", "Prompt", "PromptTooLongError", "Stats"]
