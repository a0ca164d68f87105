"""The block index contract of tests/unit/test_kv_index.py, run against a real redis-server (a process): the
same tests, collected here with this module's ``backend``; and Redis going down and coming back.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvstore.index import BlockIndex, IndexUnavailableError
from kvstore.redis_index import RedisIndex
from tandem.redis_server import RedisServer
from tests.unit.test_kv_index import (  # noqa: F401  (the contract's tests, collected here too)
    KEYS,
    Backend,
    entry,
    test_a_commit_with_one_invalid_entry_commits_nothing,
    test_a_dead_owners_key_is_taken_over,
    test_a_node_that_never_registered_is_dead,
    test_an_expired_nodes_entries_are_misses_until_purged,
    test_another_nodes_commit_keeps_the_first_owner,
    test_bytes_like_keys_are_accepted,
    test_get_answers_each_key_independently,
    test_heartbeats_keep_a_node_alive,
    test_long_lookups_cross_the_scripts_chunks,
    test_lookup_returns_the_longest_committed_prefix,
    test_lookup_stops_at_the_first_entry_of_a_dead_node,
    test_malformed_keys_are_invalid_arguments,
    test_purge_node_drops_the_node_and_its_entries,
    test_purging_a_large_node_spans_batches,
    test_recommit_by_the_same_node_overwrites,
    test_remove_drops_only_the_callers_entries,
    test_two_clients_see_each_others_commits,
)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["redis"])
def backend(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Backend]:
    b = Backend(request.param, redis_server.url)
    yield b
    b.close()


@pytest.fixture
def index(backend: Backend) -> BlockIndex:
    return backend.index


def test_redis_down_is_unavailable_and_recovers() -> None:
    server = RedisServer().start()
    index = RedisIndex(server.url, prefix="restart:")
    try:
        index.register_node("node-a", "a:1", 60)
        index.commit([entry(0)])
        server.stop()
        for call in (lambda: index.lookup(KEYS[:1]), lambda: index.commit([entry(1)]), index.nodes):
            with pytest.raises(IndexUnavailableError, match=f"Redis at {server.url} is unavailable") as err:
                call()
            assert isinstance(err.value, ConnectionError)
        server.start()  # same port, empty: the scripts must be loaded again (NOSCRIPT)
        assert index.lookup(KEYS[:1]) == []
        index.register_node("node-a", "a:1", 60)
        index.commit([entry(0)])
        assert index.lookup(KEYS[:1]) == [entry(0)]
        redis.Redis.from_url(server.url).script_flush()
        assert index.get(KEYS[:1]) == [entry(0)]
        server.stop()
        server.start()  # no failed call in between: the pooled socket is stale, one reconnect absorbs it
        assert index.nodes() == {}
        server.stop()
        server.start()  # the same for a read (its own round trip, outside redis-py's command path)
        assert index.lookup(KEYS[:1]) == [] and index.get(KEYS[:1]) == [None]
    finally:
        index.close()
        server.close()
