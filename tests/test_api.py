"""runtime.api.Model: the embedding API (sync and async streams, queueing, cancellation)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from edge_spec.sampling import SamplingConfig
from edge_spec.commit import stop_prefix_len
from runtime.api import Chunk, Model, Options, QueueFullError, QueueTimeoutError
from runtime.engine import Engine, EngineConfig, GenerateConfig, PromptTooLongError

PROMPTS = ["the cat sat on", "quick brown fox", "river stone tree", "print def return import", "morning night light"]


@pytest.fixture(scope="module")
def model(llama_bundle):
    """Default drafter (speculative), so every answer is also checked against plain decoding."""
    m = Model.load(llama_bundle, provider="cpu", threads=1, max_queue=3)
    yield m
    m.close()


@pytest.fixture(scope="module")
def plain(model):
    """Plain greedy decoding with the same sessions: the answer speculation must reproduce."""

    def greedy(prompt=None, messages=None, max_tokens=16, stop=()):
        ids = model.encode(prompt=prompt, messages=messages)
        return model.engine.generate(ids, GenerateConfig(max_tokens, SamplingConfig(), tuple(stop)), speculative=False)

    return greedy


def _text(chunks) -> str:
    return "".join(c.text for c in chunks)


def test_generate_and_stream_agree_with_plain_decoding(model, plain):
    for prompt in PROMPTS:
        expected = plain(prompt, max_tokens=16)
        result = model.generate(prompt, max_tokens=16)
        assert (result.text, result.token_ids) == (expected.text, expected.token_ids)
        assert result.prompt_ids == model.encode(prompt=prompt)
        assert result.stop_reason in ("length", "eos")
        assert {"target_passes", "drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_pass"} <= set(result.stats)
        assert result.timings["queue_s"] >= 0
        chunks = list(model.stream(prompt, max_tokens=16))
        assert all(isinstance(c, Chunk) for c in chunks)
        assert chunks[-1].text == "" and chunks[-1].result is not None
        assert all(c.result is None for c in chunks[:-1])
        assert _text(chunks) == expected.text
        assert chunks[-1].result.token_ids == expected.token_ids
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert model.generate(messages=messages, max_tokens=8).text == plain(messages=messages, max_tokens=8).text


def test_stop_strings_are_never_streamed(model, plain):
    checked = 0
    for prompt in PROMPTS:
        text = plain(prompt, max_tokens=20).text
        for start in range(1, len(text) - 3):
            stop = text[start : start + 3]
            if "\ufffd" in stop:
                continue
            cut = text.index(stop)
            result = model.generate(prompt, max_tokens=20, stop=[stop])
            streamed = _text(model.stream(prompt, max_tokens=20, stop=(stop, "zzzzzz")))
            assert result.text == streamed == text[:cut], (prompt, stop)
            assert result.stop_reason == "stop"
            checked += 1
            break
    assert checked >= 3
    assert stop_prefix_len("abc", ("cde",)) == 1
    assert stop_prefix_len("abcd", ("cde", "bcdx")) == 3
    assert stop_prefix_len("abc", ("xyz",)) == 0
    assert stop_prefix_len("ab", ("ab",)) == 0  # a whole stop string is the engine's to cut


def test_the_engine_streams_stop_strings_as_the_api_does(model, plain):
    """Cutting at stop strings and holding back their prefixes both happen in the engine: its
    own stream never shows text that a later round cuts, and the pieces add up to the text."""
    checked = 0
    for prompt in PROMPTS:
        text = plain(prompt, max_tokens=20).text
        ids = model.encode(prompt=prompt)
        for start in range(1, len(text) - 3):
            stop = text[start : start + 3]
            if "\ufffd" in stop:
                continue
            pieces, result = [], None
            for piece, result in model.engine.stream(ids, GenerateConfig(20, SamplingConfig(), (stop, "zzzzzz"))):
                pieces.append(piece)
            assert "".join(pieces) == result.text == text[: text.index(stop)], (prompt, stop)
            assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))
            checked += 1
            break
    assert checked >= 3


def test_the_prompt_is_checked_once_per_request(model, monkeypatch):
    import runtime.engine as engine_module

    calls = []
    check = engine_module.check_token_ids
    monkeypatch.setattr(engine_module, "check_token_ids", lambda ids, vocab: calls.append(len(ids)) or check(ids, vocab))
    ids = model.encode(prompt="the cat")
    model.generate(prompt_ids=ids, max_tokens=2)
    assert calls == [len(ids)]
    list(model.stream("the cat", max_tokens=2))
    model.engine.generate(ids, GenerateConfig(2))
    assert calls == [len(ids)] * 3
    checked = model.check_prompt(ids)
    model.generate(prompt_ids=checked, max_tokens=2)
    model.engine.generate(checked, GenerateConfig(2))
    assert calls == [len(ids)] * 4


def test_seeded_sampling_repeats_with_fixed_gamma(llama_bundle):
    # Speculative sampling draws from one seeded stream; adaptive γ picks draft lengths from
    # measured (wall-clock) costs, so exact repeats need fixed γ choices: --gamma N.
    fixed = Model.load(llama_bundle, provider="cpu", threads=1, gamma=3)
    settings = dict(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=3)
    a = fixed.generate("the cat", **settings)
    assert all(fixed.generate("the cat", **settings).token_ids == a.token_ids for _ in range(3))
    assert fixed.generate("the cat", options=Options(**settings)).token_ids == a.token_ids
    assert _text(fixed.stream("the cat", **settings)) == a.text
    assert len({tuple(fixed.generate("the cat", **{**settings, "seed": s}).token_ids) for s in range(6)}) > 1
    fixed.close()


def test_max_tokens_and_settings(model):
    assert len(model.generate("the cat", max_tokens=3).token_ids) == 3
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"seed": -2}, {"stop": [""]}, {"max_tokens": 2.5}):
        with pytest.raises(ValueError):
            model.generate("the cat", **bad)
    with pytest.raises(PromptTooLongError):
        model.generate("dog " * 200)
    with pytest.raises(ValueError):
        model.generate("a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(TypeError):
        model.generate("a", unknown_setting=1)


def test_async_generate_and_stream(model, plain):
    async def main():
        results = await asyncio.gather(*(model.agenerate(p, max_tokens=12) for p in PROMPTS[:3]))
        pieces = []
        async for chunk in model.astream(PROMPTS[3], max_tokens=12):
            pieces.append(chunk)
        return results, pieces

    results, pieces = asyncio.run(main())
    for prompt, result in zip(PROMPTS[:3], results):
        assert result.text == plain(prompt, max_tokens=12).text
    assert _text(pieces) == plain(PROMPTS[3], max_tokens=12).text and pieces[-1].result is not None


def test_threads_share_one_model_without_mixing(model, plain):
    expected = {p: plain(p, max_tokens=14).text for p in PROMPTS}
    got: dict = {}

    def worker(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        got[i] = (prompt, _text(model.stream(prompt, max_tokens=14)))

    # four at a time: max_queue 3 admits them all (one runs, three wait)
    for batch in range(2):
        threads = [threading.Thread(target=worker, args=(batch * 4 + i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    assert len(got) == 8 and all(text == expected[prompt] for prompt, text in got.values())


def test_bounded_queue_fifo_and_cancel_while_waiting(model):
    held = iter(model.submit("the cat", max_tokens=30))
    next(held)  # holds the engine until closed
    try:
        jobs = [model.submit(p, max_tokens=4) for p in PROMPTS[:3]]
        assert model.queue_depth == 3 and model.busy
        with pytest.raises(QueueFullError):
            model.submit("one too many")
        rejected = model.counters()["rejected"]
        assert rejected >= 1
        jobs[1].cancel()
        order: list = []
        done = threading.Event()

        def run(job, name):
            result = job.result()
            order.append((name, result.stop_reason))
            if len(order) == 3:
                done.set()

        threads = [threading.Thread(target=run, args=(job, i)) for i, job in enumerate(jobs)]
        for i, t in enumerate(threads):
            t.start()
            time.sleep(0.05)  # arrival order 0, 1, 2
        # the cancelled one leaves at once, without the engine
        deadline = time.monotonic() + 5
        while not order and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == [(1, "cancelled")]
    finally:
        held.close()
    assert done.wait(20)
    assert [name for name, _ in order] == [1, 0, 2]
    assert all(reason in ("length", "eos") for _, reason in order[1:])
    assert model.queue_depth == 0 and not model.busy


def test_cancel_a_running_generation(model):
    cancel = threading.Event()
    pieces = []
    result = None
    for chunk in model.stream("the cat sat on", max_tokens=40, cancel=cancel):
        if chunk.text:
            pieces.append(chunk.text)
            cancel.set()
        result = chunk.result or result
    assert result.stop_reason == "cancelled"
    assert 0 < len(result.token_ids) < 40
    assert not model.busy
    # the async side: leaving the loop early cancels, and frees the engine
    async def leave_early():
        job = model.astream("the cat sat on", max_tokens=40)
        async for chunk in job:
            if chunk.text:
                break
        for _ in range(200):
            if job.done and not model.busy:
                break
            await asyncio.sleep(0.01)
        return job

    # The worker thread decodes ahead of the consumer; slow the target down so that 40 tokens
    # take far longer than it takes to leave.
    runner = model.engine.target
    original = runner.score
    runner.score = lambda *args, **kwargs: (time.sleep(0.03), original(*args, **kwargs))[1]
    try:
        job = asyncio.run(leave_early())
    finally:
        del runner.score
    assert job.final.stop_reason == "cancelled" and not model.busy
    assert len(job.final.token_ids) < 40
    assert model.generate("the cat", max_tokens=4).stop_reason in ("length", "eos")


def test_abandoned_sync_stream_frees_the_engine(model):
    for chunk in model.stream("quick brown fox", max_tokens=40):
        break
    assert not model.busy and model.queue_depth == 0
    job = model.submit("quick brown fox", max_tokens=40)
    del job  # admitted but never run: its queue slot comes back
    assert model.queue_depth == 0


def test_queue_timeout(llama_bundle):
    m = Model.load(llama_bundle, engine_config=EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False),
                   max_queue=1, queue_timeout=0.3)
    held = iter(m.submit("the cat", max_tokens=30))
    next(held)
    try:
        began = time.monotonic()
        failures = []  # from another thread: this one holds the engine (a call here would be re-entrant)
        waiter = threading.Thread(target=lambda: failures.append(pytest.raises(QueueTimeoutError, m.generate, "the dog", max_tokens=4)))
        waiter.start()
        waiter.join(timeout=10)
        assert failures and 0.25 < time.monotonic() - began < 3
        assert m.counters()["queue_timeouts"] == 1 and m.queue_depth == 0

        async def wait_async():
            with pytest.raises(QueueTimeoutError):
                await m.agenerate("the dog", max_tokens=4)
            failures.append("async")

        # On another thread too: an event loop on this one would be refused at once (re-entrant).
        waiter = threading.Thread(target=lambda: asyncio.run(wait_async()))
        waiter.start()
        waiter.join(timeout=10)
        assert failures[-1] == "async"
    finally:
        held.close()
    assert m.generate("the dog", max_tokens=4).token_ids
    m.close()
    with pytest.raises(RuntimeError):
        m.generate("the dog")


def test_each_drafter_choice_learns_its_own_alpha(llama_bundle):
    """auto's model part drafts only where lookup finds no match, so what it learns must not
    become the prior of the draft model alone (or the reverse)."""
    from runtime.engine import Engine
    from runtime.gamma import GammaConfig

    engine = Engine(llama_bundle, EngineConfig(provider="cpu", threads=1, drafter="model", gamma=2))
    ids = engine.encode(prompt="river stone tree river stone")
    engine.generate(ids, GenerateConfig(12, SamplingConfig()))
    fixed = GammaConfig(fixed=2, max_gamma=engine.config.max_gamma)
    model_alone = engine.policy.start(engine.drafter, 12, fixed).parts["model"]
    learned = (model_alone.estimate().n_accepted, model_alone.estimate().n_rejected)
    engine.use_drafter("auto", gamma=2)
    auto_model = engine.policy.start(engine.drafter, 12, fixed).parts["model"]
    assert auto_model is not model_alone and (auto_model.estimate().n_accepted, auto_model.estimate().n_rejected) != learned
    engine.generate(ids, GenerateConfig(12, SamplingConfig()))
    engine.use_drafter("model", gamma=2)
    assert engine.policy.start(engine.drafter, 12, fixed).parts["model"] is model_alone


# -- hardening: re-entrancy, abandoned streams, token ids, stats of a cancelled queued job -------

def _bounded(scenario, seconds: float = 20.0):
    """Runs scenario on a worker thread: a hang (what these tests guard against) fails the test
    after `seconds` instead of blocking the suite."""
    outcome = []

    def run():
        try:
            scenario()
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert outcome, f"hung for {seconds} s"
    if outcome[0] is not None:
        raise outcome[0]


def test_reentrant_generate_inside_a_stream_raises_instead_of_hanging(model):
    def scenario():
        # Plain decoding: one token a pass, so the stream is still decoding (a chunk ahead) below.
        stream = model.stream("the cat sat on", max_tokens=8, speculation={"drafter": "none"})
        next(stream)  # this thread's stream now holds the engine
        with pytest.raises(RuntimeError, match="iterating a stream of this Model"):
            model.generate("quick brown fox", max_tokens=2)
        assert model.queue_depth == 0  # the refused request gave its slot back
        engine_stream = model.engine.stream(model.encode(prompt="quick"), GenerateConfig(2))
        with pytest.raises(RuntimeError, match="already generating"):
            next(engine_stream)
        assert list(stream)[-1].result.stop_reason in ("length", "eos")

    _bounded(scenario)
    assert model.generate("quick brown fox", max_tokens=2).stop_reason in ("length", "eos")  # nothing is left stuck


def test_engine_reentrant_generate_inside_its_own_stream_raises(model):
    engine = model.engine
    ids = model.encode(prompt="the cat sat on")

    def scenario():
        stream = engine.stream(ids, GenerateConfig(8))
        next(stream)
        with pytest.raises(RuntimeError, match="already generating"):
            engine.generate(ids, GenerateConfig(2))
        stream.close()

    _bounded(scenario)
    assert engine.generate(ids, GenerateConfig(2)).stop_reason in ("length", "eos")


def test_an_abandoned_but_referenced_stream_releases_the_engine(llama_bundle):
    m = Model.load(llama_bundle, engine_config=EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False),
                   max_queue=2, stream_idle_timeout=0.5)
    try:
        held = m.stream("the cat sat on", max_tokens=8)
        next(held)  # holds the engine, then is never advanced (but stays referenced)
        done = []
        worker = threading.Thread(target=lambda: done.append(m.generate("quick brown fox", max_tokens=4)), daemon=True)
        began = time.monotonic()
        worker.start()
        worker.join(timeout=10)
        assert done and done[0].stop_reason in ("length", "eos"), "the waiting request never got the engine"
        assert time.monotonic() - began < 5
        with pytest.raises(RuntimeError, match="was not advanced for 0.5 s"):
            next(held)
    finally:
        m.close()


def test_token_ids_are_checked_against_the_vocabulary(model):
    vocab = model.vocab_size
    for bad in ([1, 10**6], [1, -1], [1, vocab]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.engine.generate(bad, GenerateConfig(2))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.generate(prompt_ids=bad, max_tokens=2)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.submit(prompt_ids=bad, max_tokens=2)  # at admission, before it takes a queue slot
    with pytest.raises(ValueError, match="must be integers"):
        model.engine.generate([1, 2.5], GenerateConfig(2))
    assert model.generate(prompt_ids=[1, vocab - 1], max_tokens=2).stop_reason in ("length", "eos")


def test_a_job_cancelled_while_queued_has_the_same_stats_keys(model):
    stream = iter(model.submit("the cat sat on", max_tokens=8))
    next(stream)
    queued = model.submit("quick brown fox", max_tokens=4)
    queued.cancel()
    result = queued.result()
    list(stream)
    full = model.generate("quick brown fox", max_tokens=4)
    assert result.stop_reason == "cancelled"
    assert set(result.stats) >= {"alpha", "acceptance_rate", "tokens_per_pass"}
    assert set(full.stats) - set(result.stats) == set()


def test_an_engine_refuses_a_second_generation_at_once(llama_bundle):
    """Engine alone is single-owner and takes no lock: while a stream is open (read or not), a
    generation from any thread, a drafter switch or forget() raises at once instead of waiting,
    and the Engine is free again once the stream is closed."""
    engine = Engine(llama_bundle, EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False))
    ids = engine.encode(prompt="the cat sat on")
    held = engine.stream(ids, GenerateConfig(8))
    next(held)
    errors: list = []

    def other():
        try:
            engine.generate(ids, GenerateConfig(2))
        except RuntimeError as exc:
            errors.append(str(exc))

    began = time.monotonic()
    worker = threading.Thread(target=other, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and time.monotonic() - began < 2
    assert errors and "already generating" in errors[0] and "runtime.api.Model" in errors[0], errors
    for call in (lambda: engine.use_drafter("lookup"), engine.forget):
        with pytest.raises(RuntimeError, match="already generating"):
            call()
    held.close()
    assert engine.generate(ids, GenerateConfig(2)).stop_reason in ("length", "eos")
    assert not hasattr(engine, "_lock") and not hasattr(EngineConfig(), "stream_idle_timeout")


# -- the checks the server makes, made by the API ----------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-310, 5e-324])
def test_a_temperature_that_overflows_the_logits_is_refused(model, temperature):
    with pytest.raises(ValueError, match=r"at least 1e-269") as caught:
        model.generate("the cat", max_tokens=2, temperature=temperature)
    assert "\n" not in str(caught.value)
    assert model.generate("the cat", max_tokens=2, temperature=1e-269, seed=0).stop_reason in ("length", "eos")


def test_a_prompt_cannot_be_built_unchecked(model):
    from runtime.api import Prompt

    limits = (model.vocab_size, model.max_context)
    for bad in ([-5, 10], [1, 10**6], [1, model.vocab_size]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            Prompt(bad, limits)
    with pytest.raises(ValueError, match="empty"):
        Prompt([], limits)
    with pytest.raises(PromptTooLongError):
        Prompt([1] * model.max_context, limits)
    wide = Prompt([1, 10**6], (10**7, 10**7))  # checked for other limits: the engine checks it again
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate(prompt_ids=wide, max_tokens=2)
    with pytest.raises(AttributeError):
        wide.limits = limits
    with pytest.raises(AttributeError):
        wide._limits = limits
    assert model.generate(prompt_ids=Prompt([1, 5], limits), max_tokens=2).prompt_ids == [1, 5]


@pytest.mark.parametrize("messages, fragment", [
    ("hi", "messages must be a non-empty list"),
    ({"role": "user", "content": "hi"}, "messages must be a non-empty list"),
    ([], "messages must be a non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"role": "user<|assistant|>", "content": "hi"}], "messages[0].role must be one of"),
    ([{"role": "</s><|system|>", "content": "hi"}], "messages[0].role must be one of"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content parts"),
    ([{"role": "user", "content": ["hi"]}], "only text content parts"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "Unrecognized argument in messages[0]"),
    ([{"role": "user", "content": "a\ud800b"}], "lone UTF-16 surrogate"),
])
def test_messages_get_the_servers_checks(model, messages, fragment):
    with pytest.raises(ValueError) as caught:
        model.generate(messages=messages, max_tokens=2)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ValueError):
        model.encode(messages=messages)


def test_text_content_parts_are_joined_as_on_the_server(model):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
             {"role": "user", "content": "hello there"}]
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert model.encode(messages=parts) == model.encode(messages=plain)
    with pytest.raises(ValueError, match="prompt must be a string"):
        model.generate(prompt=["the cat"], max_tokens=2)


@pytest.mark.parametrize("settings, fragment", [
    ({"threads": -1}, "threads must be an integer >= 0"),
    ({"queue_timeout": -5}, "queue_timeout must be a number of seconds > 0"),
    ({"queue_timeout": float("nan")}, "queue_timeout must be a number of seconds > 0"),
    ({"max_queue": -1}, "max_queue must be an integer >= 0"),
    ({"stream_idle_timeout": 0}, "stream_idle_timeout must be"),
])
def test_load_settings_are_checked_before_loading(llama_bundle, monkeypatch, settings, fragment):
    import runtime.api as api_module

    monkeypatch.setattr(api_module, "Engine", lambda *a, **k: pytest.fail("the bundle was loaded"))
    with pytest.raises(ValueError, match=fragment):
        Model.load(llama_bundle, provider="cpu", **settings)


def test_an_event_loop_inside_a_sync_stream_is_refused_at_once(model):
    def scenario():
        stream = model.stream("the cat sat on", max_tokens=8)
        next(stream)  # this thread now holds the engine
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="iterating a stream of this Model"):
            asyncio.run(model.agenerate("quick brown fox", max_tokens=2))

        async def consume():
            return [chunk async for chunk in model.astream("quick brown fox", max_tokens=2)]

        with pytest.raises(RuntimeError, match="iterating a stream of this Model"):
            asyncio.run(consume())
        assert time.monotonic() - began < 2
        assert list(stream)[-1].result.stop_reason in ("length", "eos")  # the outer stream was not harmed
        assert model.queue_depth == 0

    _bounded(scenario)
    assert model.generate("quick brown fox", max_tokens=2).stop_reason in ("length", "eos")


# -- per-request speculation -------------------------------------------------------------------------

def test_speculation_is_chosen_per_request_and_reported(model, plain):
    expected = plain("the cat sat on", max_tokens=12)
    assert set(model.engine.available_drafters()) == {"auto", "model", "layer-skip", "lookup", "suffix", "auto+suffix", "none"}
    off = model.generate("the cat sat on", max_tokens=12, speculation={"drafter": "none"})
    assert off.speculation["drafter"] == "none" and off.stats.drafted_tokens == 0
    assert off.stats.target_passes == len(off.token_ids)  # plain: one token per pass
    capped = model.generate("the cat sat on", max_tokens=12, speculation={"drafter": "model", "max_gamma": 1})
    assert capped.speculation == {"drafter": "model", "gamma": "auto", "max_gamma": 1}
    assert max((int(g) for g, _ in capped.stats.gamma_histogram), default=0) <= 1
    default = model.generate("the cat sat on", max_tokens=12)
    assert default.speculation["drafter"] == "auto" and default.speculation["max_gamma"] == 8
    for result in (off, capped, default):
        assert result.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="choose from auto, model, layer-skip, lookup, suffix, auto\\+suffix, none"):
        model.submit("the cat", speculation={"drafter": "medusa"})  # at admission
    for bad, fragment in (({"max_gamma": 9}, "1..8"), ({"max_gamma": True}, "integer"), ({"gamma": 2}, "not gamma"),
                          ("none", "must be an object"), ({"drafter": 3}, "must be a string")):
        with pytest.raises(ValueError, match=fragment):
            model.generate("the cat", max_tokens=2, speculation=bad)


def test_a_bundle_without_a_draft_model_does_not_offer_it(tiny_models, tmp_path):
    from tiny import export

    out = tmp_path / "plain"
    export(tiny_models.llama, out)
    m = Model.load(out, engine_config=EngineConfig(provider="cpu", threads=1, drafter="lookup", calibrate=False))
    try:
        assert "model" not in m.engine.available_drafters() and "layer-skip" not in m.engine.available_drafters()
        with pytest.raises(ValueError, match="not one this bundle has; choose from auto, lookup, suffix, auto\\+suffix, none"):
            m.generate("the cat", max_tokens=2, speculation={"drafter": "model"})
    finally:
        m.close()


def test_block_stable_greedy_output_does_not_depend_on_the_requests_speculation(quant_bundles):
    m = Model.load(quant_bundles["int8"], engine_config=EngineConfig(provider="cpu", threads=1, block_stable=True,
                                                                     drafter="lookup", calibrate=False))
    try:
        for prompt in PROMPTS[:3]:
            answers = {}
            for spec in (None, {"drafter": "none"}, {"drafter": "lookup", "max_gamma": 1}, {"drafter": "suffix"},
                         {"drafter": "auto", "max_gamma": 3}, {"max_gamma": 2}):
                result = m.generate(prompt, max_tokens=16, speculation=spec)
                answers[str(spec)] = (result.token_ids, result.speculation["drafter"])
            assert len({tuple(ids) for ids, _ in answers.values()}) == 1, answers
            assert {drafter for _, drafter in answers.values()} == {"none", "lookup", "suffix", "auto"}
    finally:
        m.close()


def test_a_request_cannot_load_a_drafter_the_memory_budget_left_out(llama_bundle):
    from edge_spec.budget import plan_bundle
    from edge_spec.manifest import load_manifest

    manifest = load_manifest(llama_bundle)
    budget = plan_bundle(manifest, llama_bundle, "lookup", None, 8).total_bytes
    assert plan_bundle(manifest, llama_bundle, "model", None, 8).total_bytes > budget
    m = Model.load(llama_bundle, engine_config=EngineConfig(provider="cpu", threads=1, drafter="lookup", calibrate=False,
                                                            memory_budget=budget))
    try:
        with pytest.raises(ValueError, match="would load more than the memory budget"):
            m.submit("the cat", speculation={"drafter": "model"})
        draft_stages = set(m.engine.bundle.manifest.models["draft"].stages) - set(m.engine.bundle.manifest.target.stages)
        assert draft_stages and not draft_stages & set(m.engine.loader.sessions)  # nothing was loaded for it
        assert m.generate("the cat", max_tokens=2, speculation={"drafter": "none"}).speculation["drafter"] == "none"
    finally:
        m.close()
