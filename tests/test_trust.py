"""Trust boundaries (docs/security-and-observability.md#trust-boundaries): nothing a
hub, a fleet peer, a client or a file sends writes outside its place, fills the disk,
stalls the server or reaches another key's data.

The hostile hub is ``tests/hub.py`` with its lying knobs; the lying peer is
``tests/peer.py``. Pulls run ``mlxfleet.store.pull`` in a fresh process, as a node or
``mlxfleet pull`` does.
"""

from __future__ import annotations

import pytest
from hub import Hub, Repo
from peer import LyingPeer, run_pull, written_under

from mlxfleet.builtin import ensure_builtin

KEY = "trust-key"


@pytest.fixture(scope="module")
def tiny_repo():
    return Repo.from_dir(ensure_builtin("tiny"))


@pytest.fixture()
def hub(tiny_repo):
    h = Hub({"acme/tiny": tiny_repo})
    yield h
    h.close()


def weights_name(repo: Repo) -> str:
    return next(n for n in repo.files if n.endswith(".safetensors"))


# ---- a hostile hub ------------------------------------------------------------------

@pytest.mark.parametrize("lie", ["oid", "path"])
def test_a_hub_listing_that_climbs_out_of_the_cache_writes_nothing_there(hub, tiny_repo,
                                                                         tmp_path, lie):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x.incomplete").write_bytes(b"12345")  # a resume would append to it
    cache = tmp_path / "hf"
    name = weights_name(tiny_repo)
    up = "../" * 12 + str(victim).lstrip("/") + "/x"
    # (a path must look like a file a load needs, or it is not even asked for)
    hub.lie[name] = {"oid": up} if lie == "oid" else {"path": up + ".json"}
    ok, out = run_pull(hub.env(cache), "acme/tiny")
    assert not ok and "refused" in out, out
    assert written_under(victim) == ["x.incomplete"], written_under(victim)
    assert (victim / "x.incomplete").read_bytes() == b"12345"  # not resumed, not deleted
    # and nothing of it landed in the cache either
    assert not any("snapshots" in p for p in written_under(cache)), written_under(cache)


def test_a_hub_that_sends_more_than_it_listed_is_stopped_at_the_listed_size(hub, tiny_repo,
                                                                          tmp_path):
    name = weights_name(tiny_repo)
    size = len(tiny_repo.files[name])
    hub.overflow[name] = 64 << 20  # 64 MB more, with no Content-Length
    cache = tmp_path / "hf"
    ok, out = run_pull(hub.env(cache), "acme/tiny")
    assert not ok and "sent more than" in out, out
    on_disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert on_disk <= size + (1 << 20), on_disk  # (158 MB were written before)


def test_a_pull_that_would_fill_the_disk_is_refused_before_a_byte(hub, tiny_repo, tmp_path):
    name = weights_name(tiny_repo)
    hub.lie[name] = {"size": 900 << 30}  # 900 GB, more than this disk has free
    cache = tmp_path / "hf"
    ok, out = run_pull(hub.env(cache), "acme/tiny")
    assert not ok and "ERR 507" in out and "free" in out, out
    assert not any(p.name.endswith(".incomplete") for p in cache.rglob("*"))
    assert not any(m == "GET" and p.endswith(name) for m, p, _ in hub.log)


def test_a_hub_that_goes_silent_is_given_up_on_after_the_idle_timeout(hub, tmp_path):
    hub.stall = 30.0
    ok, out = run_pull(hub.env(tmp_path / "hf"), "acme/tiny", limits={"idle_timeout": 1.0},
                       timeout=25)
    assert not ok and "sent nothing for 1s" in out and "ERR 504" in out, out


def test_a_pull_past_its_deadline_stops_and_says_how_to_continue(hub, tmp_path):
    hub.throttle = 0.2  # 64 KiB per 0.2 s: the weights take several seconds
    ok, out = run_pull(hub.env(tmp_path / "hf"), "acme/tiny", limits={"timeout": 1.0},
                       timeout=60)
    assert not ok and "took longer than 1s" in out and "continue" in out, out


# ---- a lying peer -------------------------------------------------------------------

def test_a_peer_listing_that_climbs_out_of_the_cache_is_ignored(hub, tiny_repo, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    peer = LyingPeer(tiny_repo, KEY, "traversal", target=str(victim))
    try:
        ok, out = run_pull(hub.env(tmp_path / "hf"), "acme/tiny",
                           [{"name": "evil", "url": peer.url, "key": KEY}])
    finally:
        peer.close()
    assert ok, out  # from the hub, whose listing is the truth
    assert written_under(victim) == [], written_under(victim)
    assert "/mlxfleet/v1/store/file" not in peer.log  # nothing was taken from it


def test_weights_a_peer_substitutes_never_enter_the_cache(hub, tiny_repo, tmp_path):
    import hashlib

    peer = LyingPeer(tiny_repo, KEY, "substitute")
    cache = tmp_path / "hf"
    try:
        ok, out = run_pull(hub.env(cache), "acme/tiny",
                           [{"name": "evil", "url": peer.url, "key": KEY}])
    finally:
        peer.close()
    assert ok and "from node evil failed" in out, out
    name = weights_name(tiny_repo)
    got = next(cache.rglob(f"snapshots/*/{name}")).read_bytes()
    assert hashlib.sha256(got).digest() == hashlib.sha256(tiny_repo.files[name]).digest()


def test_with_the_hub_down_a_peer_is_not_taken_at_its_word(tiny_repo, tmp_path):
    peer = LyingPeer(tiny_repo, KEY, "honest")
    down = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hf"),
            "HF_HUB_DISABLE_XET": "1"}
    try:
        ok, out = run_pull(down, "acme/tiny", [{"name": "b", "url": peer.url, "key": KEY}])
        assert not ok and "cannot reach the hub" in out, out
        # an operator of an offline fleet may opt in: a listing signed with the fleet key
        ok, out = run_pull(down, "acme/tiny", [{"name": "b", "url": peer.url, "key": KEY}],
                           limits={"peer_without_hub": True})
        assert ok and "signed listing" in out, out
        # never one signed with another key
        ok, out = run_pull({**down, "HF_HUB_CACHE": str(tmp_path / "hf2")}, "acme/tiny",
                           [{"name": "b", "url": peer.url, "key": "other"}],
                           limits={"peer_without_hub": True})
        assert not ok, out
    finally:
        peer.close()
