"""The host link as one timeline: the hidden copies' arithmetic, and the price of exposed copies."""

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from jaxoffload import Lean, Offload, Store
from jaxoffload._src.planner import BlockCost, BlockCosts, estimate_step_ms
from jaxoffload._src.planner.hiding import LINK_SHARE, copy_timeline, hidden_copies

MB = 10**6


def _starts_back(backward):
    return [sum(backward[j + 1 :]) for j in range(len(backward))]


def test_the_first_blocks_move_most_and_each_copy_has_its_own_time_on_the_link():
    # Four 1 ms blocks, 50 GB/s at 90%: 45 MB a ms. Block 0's copies run from 1 ms to the
    # turn at 4 ms at the latest: all its 80 MB go (1.8 ms). Block 1's start when those end.
    copies = hidden_copies(
        [1, 1, 1, 1], [2, 2, 2, 2], [[60 * MB, 20 * MB]] * 4, (50, 50), link_share=0.9
    )
    first, second, third, last = copies
    assert first.moved == 80 * MB and first.to_host_ms == pytest.approx((1.0, 1 + 80 / 45))
    assert second.moved == 20 * MB  # 55 MB of time left: the 60 MB residual does not fit
    assert second.to_host_ms[0] == pytest.approx(first.to_host_ms[1])
    assert third.moved == 20 * MB
    assert last is None  # it ends at the turn: no compute after it
    # Block 0's copies end at 2.8 ms, in block 2's forward pass: window 3.
    assert first.window == 3 and second.window == 3 and third.window == 2
    # Its fetch ends as block 0's backward pass starts (6 ms after the turn) and starts
    # at 4.2 ms, after block 1's backward pass starts (4 ms): fetch window 2.
    assert first.fetch_ms == pytest.approx((6 - 80 / 45, 6.0))
    assert first.fetch_window == 2
    # Block 1's fetch ends when block 0's starts, before block 1's backward pass would.
    assert second.fetch_ms[1] == pytest.approx(min(4.0, first.fetch_ms[0]))


def test_a_copy_frees_the_peak_only_if_the_blocks_after_it_keep_what_is_still_in_flight():
    # 45 MB a ms. Block 0's 120 MB would run from 1 to 3.7 ms, until block 3 waits for it:
    # when block 2 ends it is still in flight, and only block 3's 10 MB are kept after that,
    # so the peak would fall by 10 MB, not 120 (docs/design.md, "Copies that hide"). It
    # stays; blocks 1 and 2 move their 10 MB, each done while the blocks after keep as much.
    copies = hidden_copies(
        [1] * 4, [2] * 4, [[120 * MB], [10 * MB], [10 * MB], [10 * MB]], (50, 50), link_share=0.9
    )
    assert [c and (c.moved // MB, c.window) for c in copies] == [None, (10, 2), (10, 2), None]


def test_a_residual_over_what_the_link_can_carry_in_time_stays_and_crumbs_do_not_move():
    # 400 MB takes 8.9 ms; 3 ms of forward pass follow block 0. Only the 4 KB beside it fit,
    # under 5% of the block's residuals: nothing moves.
    copies = hidden_copies([1] * 4, [2] * 4, [[400 * MB, 4000]] * 4, (50, 50), link_share=0.9)
    assert copies == [None] * 4
    with pytest.raises(ValueError, match="one entry per block"):
        hidden_copies([1, 1], [2], [[1], [1]], (50, 50))
    with pytest.raises(ValueError, match="link must be two positive speeds"):
        hidden_copies([1], [2], [[1]], (0, 50))


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(
            st.floats(0.1, 3.0),  # forward ms
            st.floats(0.1, 6.0),  # backward ms
            st.lists(st.integers(1, 200 * MB), min_size=1, max_size=4),  # residuals
        ),
        min_size=1,
        max_size=12,
    ),
    link=st.tuples(st.floats(5.0, 100.0), st.floats(5.0, 100.0)),
)
def test_hidden_copies_take_turns_on_the_link_and_finish_in_time(blocks, link):
    forward = [b[0] for b in blocks]
    backward = [b[1] for b in blocks]
    sizes = [b[2] for b in blocks]
    copies = hidden_copies(forward, backward, sizes, link)
    ends, starts_back = list(itertools.accumulate(forward)), _starts_back(backward)
    out_rate, back_rate = (g * 1e6 * LINK_SHARE for g in link)
    eps = 1e-9
    chosen = [(i, c) for i, c in enumerate(copies) if c is not None]
    in_flight = [0] * len(blocks)  # bytes still copied to the host when each block ends
    for i, c in chosen:
        # What moves is what Offload(max_bytes=...) moves of this block's residuals.
        strategy = Offload(max_bytes=c.moved)
        assert c.moved == sum(s for s, go in zip(sizes[i], strategy.moved(tuple(sizes[i]))) if go)
        # Copies to the host: after the block, done by the turn, at the link's pace.
        start, end = c.to_host_ms
        assert start >= ends[i] - eps and end <= ends[-1] + eps
        assert end - start == pytest.approx(c.moved / out_rate)
        # The block that waits for them is the first whose forward pass ends after them.
        waiting = i + c.window - 1
        assert ends[waiting] >= end - eps and (waiting == i or ends[waiting - 1] < end)
        in_flight[i:waiting] = [b + c.moved for b in in_flight[i:waiting]]
        # Fetches: after the turn, before the block's backward pass, at the link's pace,
        # started by the latest backward pass that starts in time.
        f0, f1 = c.fetch_ms
        assert f0 >= -eps and f1 <= starts_back[i] + eps
        assert f1 - f0 == pytest.approx(c.moved / back_rate)
        trigger = starts_back[i + c.fetch_window - 1]
        assert trigger <= f0 + eps
        assert c.fetch_window == 1 or starts_back[i + c.fetch_window - 2] > f0 - eps
    # The copies free memory at the peak: when each block ends, the blocks after it keep
    # at least what is still in flight (each keeps what it may move).
    assert all(in_flight[g] <= sum(map(sum, sizes[g + 1 :])) for g in range(len(blocks)))
    # One copy at a time, each way.
    for key in ("to_host_ms", "fetch_ms"):
        spans = sorted(getattr(c, key) for _, c in chosen)
        assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:]))
    # Priced at the full link, the schedule's copies cost nothing beyond the compute.
    moved = [c.moved if c else 0 for c in copies]
    windows = [c.window if c else 1 for c in copies]
    fetch_windows = [c.fetch_window if c else 1 for c in copies]
    got = copy_timeline(forward, backward, moved, windows, fetch_windows, link)
    assert got == pytest.approx((sum(forward), sum(backward)))


def test_exposed_copies_are_priced_by_the_waits_that_the_chain_makes():
    forward, backward = [1.0] * 4, [2.0] * 4
    link = (2.0, 2.0)  # 2 MB a ms
    moved = [2 * MB] * 4  # 1 ms each way
    # Window 1: each block waits for its own copies, and each backward pass for its fetch.
    assert copy_timeline(forward, backward, moved, [1] * 4, [1] * 4, link) == (8.0, 12.0)
    # Window 2: a block's copies run under the next block; the last block's under nothing.
    # Fetching one block ahead: only the first fetch is waited for.
    assert copy_timeline(forward, backward, moved, [2] * 4, [2] * 4, link) == (5.0, 9.0)
    # Copies share the link: two blocks' 3 ms copies do not hide under each other's 1 ms.
    big = [6 * MB, 6 * MB, 0, 0]
    fwd, _ = copy_timeline(forward, backward, big, [4, 3, 1, 1], [1] * 4, link)
    assert fwd == pytest.approx(1 + 3 + 3)  # block 0's copies from 1 ms, then block 1's


def test_the_planner_prices_a_plan_by_the_same_timeline():
    def blocks(host):
        costs = {
            Store(): BlockCost(100, 10, 0, 0, 0, 1.0, 2.0),
            Lean(): BlockCost(40, 10, 0, 0, 0, 1.0, 2.0),
            Offload(): BlockCost(0, 0, 0, host, 0, 1.0, 2.0, (host,)),
        }
        return [BlockCosts(f"Block_{i}", 10, 10, costs) for i in range(4)]

    stand_in = blocks(2 * MB)
    assert estimate_step_ms(stand_in, [Offload()] * 4, (2.0, 2.0)) == pytest.approx(20.0)
    plan = [Offload(window=2, fetch_window=2)] * 4
    assert estimate_step_ms(stand_in, plan, (2.0, 2.0)) == pytest.approx(14.0)
    # A cap moves less: Offload(max_bytes=...) of a residual over it moves nothing.
    capped = [Offload(max_bytes=MB)] * 4
    assert estimate_step_ms(stand_in, capped, (2.0, 2.0)) == pytest.approx(12.0)
