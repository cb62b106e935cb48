"""Clients of one server apart (issue 54): the suffix cache copies only a client's own text, one
client's many requests cannot starve another's, and wrong keys from one local process do not lock
out another that holds the right key.

The probes run greedy with a fixed γ, so every round drafts what the cache offers and the same
prompt decodes the same tokens: what differs between two runs is only what the cache held. The
turns are checked on the scripted engine (no timing), the throttle through the ASGI app.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("uvicorn")

from runtime.api import Model, QueueFullError  # noqa: E402
from runtime.drafters.suffix import SuffixDrafter, SuffixIndex, SuffixSettings  # noqa: E402
from runtime.engine import EngineConfig  # noqa: E402
from runtime.requests import Options, SettingError  # noqa: E402
from runtime.server import ApiError, Server, ServerConfig  # noqa: E402
from runtime.server.security import client_identity  # noqa: E402
from tests.test_scheduler import bounded, scripted, wait_until  # noqa: E402
from tests.test_server import KEY, request, serving  # noqa: E402
from tests.test_server_networks import asgi_get, stub_model  # noqa: E402

OTHER_KEY = "sk-edge-spec-another-app"
SECRET = "the quick brown fox jumps over the lazy dog and ran fast"
DECOY = "green tree house river stone morning night light dark water"
PROBE = "the quick brown fox jumps over"  # the start of SECRET: the cache knows what follows


# -- the suffix cache ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def suffix_models(llama_bundle):
    models = {mode: Model.load(llama_bundle, max_queue=4, engine_config=EngineConfig(
        provider="cpu", threads=1, drafter="suffix", gamma=4, calibrate=False, suffix_cache=mode))
        for mode in ("per-client", "shared")}
    yield models
    for model in models.values():
        model.close()


def _drafted(port: int, prompt: str, key: str | None, user: str | None = None) -> int:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **({"user": user} if user else {})}
    status, _, answer = request(port, "POST", "/v1/completions", body, key=key, timeout=60)
    assert status == 200, answer
    return answer["speculative"]["drafted_tokens"]


def _probe(model: Model, port: int, sender: tuple, prober: tuple, sent: str = SECRET) -> int:
    """Tokens drafted for PROBE by `prober` right after `sender` sent `sent`, on an empty cache."""
    model.engine.forget()
    _drafted(port, sent, *sender)
    return _drafted(port, PROBE, *prober)


def test_another_clients_text_cannot_be_probed_but_ones_own_is_copied(suffix_models):
    model = suffix_models["per-client"]
    with serving(Server(model, api_keys=(KEY, OTHER_KEY))) as (port, _):
        nobody = _probe(model, port, (KEY, "alice"), (KEY, "bob"), sent=DECOY)
        # Another user of the same key, and another key, draft as if nobody had sent the phrase.
        assert _probe(model, port, (KEY, "alice"), (KEY, "bob")) == nobody
        assert _probe(model, port, (OTHER_KEY, None), (KEY, None)) == nobody
        # The client's own earlier text is still copied.
        assert _probe(model, port, (KEY, "bob"), (KEY, "bob")) > nobody
    # No key, on loopback: the user field tells clients apart; without it, loopback is one client.
    with serving(Server(model)) as (port, _):
        assert _probe(model, port, (None, "alice"), (None, "bob")) == _probe(model, port, (None, "alice"), (None, "bob"), DECOY)
        assert _probe(model, port, (None, None), (None, None)) > nobody


def test_a_shared_cache_is_an_explicit_opt_in(suffix_models):
    model = suffix_models["shared"]
    with serving(Server(model, api_keys=(KEY, OTHER_KEY))) as (port, _):
        nobody = _probe(model, port, (KEY, "alice"), (KEY, "bob"), sent=DECOY)
        assert _probe(model, port, (OTHER_KEY, "alice"), (KEY, "bob")) > nobody
    with pytest.raises(ValueError, match="suffix_cache must be one of per-client, shared, got 'everyone'"):
        EngineConfig(suffix_cache="everyone")


def test_the_clients_caches_share_one_budget():
    drafter = SuffixDrafter(SuffixIndex(SuffixSettings(max_tokens=20)))
    for client, base in (("a", 100), ("b", 200)):
        drafter.serve(client)  # the previous client's sequence goes into its own cache here
        drafter.reset(np.array([base]))
        drafter.accepted(np.arange(base, base + 12), 0)
    drafter.serve("b")  # b's 12 tokens come in over the budget of 20: a, served least recently, makes room
    assert drafter.find(np.array([1, 200, 201]), 4).tolist() == [202, 203, 204, 205]
    drafter.serve("a")
    assert len(drafter.find(np.array([1, 100, 101]), 4)) == 0
    assert len(drafter.find(np.array([1, 200, 201]), 4)) == 0  # b's text is not a's to copy
    assert sum(index.n_tokens for index in drafter._indexes.values()) == 12


def test_identity_is_the_key_or_the_address_and_the_user():
    config = ServerConfig()
    key = client_identity("k1", None, "127.0.0.1", config)
    assert key == client_identity("k1", None, "192.0.2.7", config) == client_identity("k1", "", "::1", config)
    assert len({key, client_identity("k2", None, "127.0.0.1", config), client_identity("k1", "alice", "127.0.0.1", config),
                client_identity("k1", "bob", "127.0.0.1", config)}) == 4
    # Without a key: every loopback address is one client, an IPv6 host is its /64, an IPv4 host its address.
    assert client_identity(None, None, "127.0.0.1", config) == client_identity(None, None, "127.0.0.9", config)
    assert client_identity(None, "alice", "127.0.0.1", config) != client_identity(None, "bob", "127.0.0.1", config)
    assert client_identity(None, None, "2001:db8::1", config) == client_identity(None, None, "2001:db8::2", config)
    assert client_identity(None, None, "192.0.2.7", config) != client_identity(None, None, "192.0.2.8", config)
    with pytest.raises(ApiError) as caught:
        client_identity(None, 7, "127.0.0.1", config)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "user", "invalid_type")
    # The Python API takes the same value as a request setting.
    assert Options(client="alice").generate_config().client == "alice"
    with pytest.raises(SettingError, match="client must be a non-empty string") as caught:
        Options(client="")
    assert caught.value.param == "client"


# -- turns between clients ----------------------------------------------------------------------

def test_a_client_with_many_requests_cannot_starve_another():
    model, engine = scripted(max_queue=8)
    gate = engine.hold(0)
    first = model.submit(prompt_ids=[0, 1], max_tokens=2, client="greedy")
    runner = threading.Thread(target=first.result)
    runner.start()
    wait_until(engine.at_gate.is_set, "the greedy client's first request to hold the engine")
    greedy = [model.submit(prompt_ids=[k, 1], max_tokens=2, client="greedy") for k in range(1, 7)]
    threads = [threading.Thread(target=job.result) for job in greedy]
    for t in threads:
        t.start()
    wait_until(lambda: model._scheduler.waiting == len(greedy), "the greedy client's requests to join the line")
    other = model.submit(prompt_ids=[7, 1], max_tokens=2, client="other")  # joins the line behind all of them
    threads.append(threading.Thread(target=other.result))
    threads[-1].start()
    wait_until(lambda: model._scheduler.waiting == len(greedy) + 1, "the other client's request to join the line")
    gate.set()
    for t in (runner, *threads):
        t.join(timeout=20)
    assert not any(t.is_alive() for t in (runner, *threads))
    # The other client takes the next free slot; the greedy client's requests keep their own order.
    order = engine.served()
    assert order[:2] == [0, 7], order
    assert [k for k in order if k not in (0, 7)] == sorted(range(1, 7), key=lambda k: greedy[k - 1]._sequence.enqueued_at)


def test_one_client_cannot_hold_the_whole_queue():
    model, engine = scripted(max_queue=6, max_per_client=3)
    gate = engine.hold(0)

    def scenario():
        held = [model.submit(prompt_ids=[k, 1], max_tokens=2, client="greedy") for k in range(3)]
        with pytest.raises(QueueFullError, match="this client already has 3 request"):
            model.submit(prompt_ids=[3, 1], max_tokens=2, client="greedy")
        other = model.submit(prompt_ids=[4, 1], max_tokens=2, client="other")  # four places are still free
        gate.set()
        assert [job.result().token_ids for job in (*held, other)] == [[0, 1]] * 4
        model.submit(prompt_ids=[5, 1], max_tokens=2, client="greedy").result()  # its places came back

    bounded(scenario)
    with pytest.raises(ValueError, match="max_per_client must be an integer >= 1"):
        scripted(max_queue=6, max_per_client=0)


# -- wrong keys -------------------------------------------------------------------------------

def test_wrong_keys_from_one_process_do_not_lock_out_the_right_key_from_the_same_address():
    server = Server(stub_model(), api_keys=(KEY, OTHER_KEY),
                    config=ServerConfig(auth_failures=3, auth_failures_global=10, auth_window=30.0))
    assert asgi_get(server, "/v1/models", "127.0.0.1", KEY)[0] == 200  # a local client at work
    statuses = [asgi_get(server, "/v1/models", "127.0.0.1", f"wrong-{i}")[0] for i in range(5)]
    assert statuses == [401] * 3 + [429] * 2, statuses  # another local process guesses, and is throttled
    assert asgi_get(server, "/v1/models", "127.0.0.1", KEY)[0] == 200  # the working client is not locked out
    # The throttled network still cannot probe: a key never accepted from it gets the wrong key's 429.
    status, body = asgi_get(server, "/v1/models", "127.0.0.1", OTHER_KEY)
    assert status == 429 and body["error"]["code"] == "auth_throttled"
    # Its guesses stay bounded: past auth_failures_global wrong keys in the window, the accepted key waits too.
    for i in range(5):
        asgi_get(server, "/v1/models", "127.0.0.1", f"more-{i}")
    assert asgi_get(server, "/v1/models", "127.0.0.1", KEY)[0] == 429
