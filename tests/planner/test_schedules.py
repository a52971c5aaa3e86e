"""Pipeline schedules: invariants of the instruction lists, a threaded executor, simulated timing."""

import dataclasses
import itertools
import queue
import threading

import pytest

from torchpar.planner.pipeline.schedules import (
    Instruction,
    format_schedule,
    gpipe,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    interleaved_one_f_one_b,
    num_device_groups,
    simulate,
    stage_lists,
    validate,
    zb_h1,
)

BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}
GRID = [(name, S, M) for name in BUILDERS for S in range(1, 5) for M in range(1, 9)]
IDS = [f"{name}-S{S}-M{M}" for name, S, M in GRID]


def compute_order(steps, op):
    return [ins.micro_batch for ins in steps if ins.op == op]


def channel_traffic(schedule, kinds):
    """(src, dst, kind) → micro-batches in list order, from the sending (or receiving) side."""
    traffic = {}
    for stage, steps in enumerate(schedule):
        for ins in steps:
            if ins.op in kinds:
                kind = ins.op.split("_")[1]
                key = (stage, ins.peer, kind) if ins.op.startswith("send") else (ins.peer, stage, kind)
                traffic.setdefault(key, []).append(ins.micro_batch)
    return traffic


def run_threaded(schedule, timeout=10.0):
    """Execute the lists: one thread per list (device group), a FIFO queue per (src, dst, kind) of stages,
    blocking recvs.

    Activations carry a number: stage 0's forward of m emits m, each later forward adds 1, so the last
    stage sees m + N - 1; gradients carry it back unchanged. A split backward hands the gradient on at its
    ``backward_input``; its ``backward_weight`` must come after it and before ``free``. Returns the
    per-stage log of received values; raises if a list waits more than ``timeout`` seconds (a deadlock)
    or gets a wrong value.
    """
    N = len(stage_lists(schedule))
    channels = {(s, d, k): queue.Queue() for s in range(N) for d in range(N) for k in ("act", "grad")}
    errors, logs = [], [[] for _ in range(N)]

    def worker(group):
        try:
            saved, inbox, grad, weight_done = {}, {}, {}, set()
            for ins in schedule[group]:
                m, stage = ins.micro_batch, ins.stage_in(group)
                if ins.op in ("recv_act", "recv_grad"):
                    got_m, value = channels[(ins.peer, stage, ins.kind)].get(timeout=timeout)
                    assert got_m == m, f"stage {stage} {ins}: got micro-batch {got_m}"
                    inbox[(stage, ins.kind, m)] = value
                    logs[stage].append((ins.kind, m, value))
                elif ins.op == "forward":
                    saved[(stage, m)] = inbox.pop((stage, "act", m)) + 1 if stage > 0 else m
                elif ins.op == "send_act":
                    channels[(stage, ins.peer, "act")].put((m, saved[(stage, m)]))
                elif ins.op in ("backward", "backward_input"):
                    # the last stage's "loss" is its forward value
                    grad[(stage, m)] = inbox.pop((stage, "grad", m)) if stage < N - 1 else saved[(stage, m)]
                    assert (stage, m) in saved
                    if ins.op == "backward":
                        weight_done.add((stage, m))
                elif ins.op == "backward_weight":
                    assert (stage, m) in grad and (stage, m) in saved and (stage, m) not in weight_done
                    weight_done.add((stage, m))
                elif ins.op == "send_grad":
                    channels[(stage, ins.peer, "grad")].put((m, grad[(stage, m)]))
                elif ins.op == "free":
                    assert (stage, m) in weight_done, f"stage {stage}: {ins} before the weight gradient"
                    del saved[(stage, m)]
                elif ins.op == "update":
                    assert not saved, f"list {group} updates with residuals of {sorted(saved)} alive"
        except Exception as e:  # noqa: BLE001 - reported to the main thread
            errors.append(f"list {group}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(g,), daemon=True) for g in range(len(schedule))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout + 5)
    assert not any(t.is_alive() for t in threads), "executor hung"
    assert not errors, errors
    assert all(q.empty() for q in channels.values()), "messages left unreceived"
    return logs


@pytest.mark.parametrize("name,S,M", GRID, ids=IDS)
def test_schedule_invariants(name, S, M):
    schedule = BUILDERS[name](S, M)
    validate(schedule)
    assert len(schedule) == S
    for stage, steps in enumerate(schedule):
        forwards, backwards = compute_order(steps, "forward"), compute_order(steps, "backward")
        assert sorted(forwards) == sorted(backwards) == list(range(M))
        position = {(ins.op, ins.micro_batch): j for j, ins in enumerate(steps)}
        for m in range(M):
            assert position[("forward", m)] < position[("backward", m)] < position[("free", m)]
        assert [ins.op for ins in steps].count("update") == 1 and steps[-1] == Instruction("update")
        ops = {ins.op for ins in steps}
        assert ("recv_act" in ops) == (stage > 0) and ("send_grad" in ops) == (stage > 0)
        assert ("recv_grad" in ops) == (stage < S - 1) and ("send_act" in ops) == (stage < S - 1)
    sends = channel_traffic(schedule, ("send_act", "send_grad"))
    recvs = channel_traffic(schedule, ("recv_act", "recv_grad"))
    assert sends == recvs  # pairwise and in order
    assert set(sends) == {(i, i + 1, "act") for i in range(S - 1)} | {(i + 1, i, "grad") for i in range(S - 1)}


@pytest.mark.parametrize("name,S,M", GRID, ids=IDS)
def test_threaded_executor_terminates(name, S, M):
    logs = run_threaded(BUILDERS[name](S, M))
    if S > 1:
        assert [v for kind, m, v in logs[S - 1] if kind == "act"] == [m + S - 2 for m in range(M)]
        assert sorted(v for kind, m, v in logs[0] if kind == "grad") == [m + S - 1 for m in range(M)]


@pytest.mark.parametrize("name,S,M", GRID, ids=IDS)
def test_in_flight(name, S, M):
    peaks = max_in_flight(BUILDERS[name](S, M))
    if name == "gpipe":
        assert peaks == [M] * S
    else:
        assert peaks == [min(S - i, M) for i in range(S)]
        assert all(p <= S - i for i, p in enumerate(peaks))


@pytest.mark.parametrize("name,S,M", GRID, ids=IDS)
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.5, 3.0), (2.0, 1.0)])
def test_uniform_makespan_and_bubble(name, S, M, f, b):
    timeline = simulate(BUILDERS[name](S, M), f, b)
    assert timeline.makespan == pytest.approx((M + S - 1) * (f + b))
    assert timeline.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    assert timeline.busy == pytest.approx([M * (f + b)] * S)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("S,M", [(8, 1), (8, 7), (16, 32), (64, 128)])
def test_large_pipelines(name, S, M):
    schedule = BUILDERS[name](S, M)
    validate(schedule)
    assert max_in_flight(schedule) == ([M] * S if name == "gpipe" else [min(S - i, M) for i in range(S)])
    assert simulate(schedule, 1.0, 2.0).makespan == pytest.approx(3.0 * (M + S - 1))


@pytest.mark.parametrize("name", BUILDERS)
def test_simulated_blocks_respect_dependencies(name):
    S, M = 3, 5
    timeline = simulate(BUILDERS[name](S, M), [1.0, 3.0, 2.0], [2.0, 1.0, 4.0], update_time=0.5)
    start = {}
    for stage, blocks in enumerate(timeline.blocks):
        assert [b.op for b in blocks].count("forward") == M and blocks[-1].op == "update"
        for prev, nxt in itertools.pairwise(blocks):
            assert prev.end <= nxt.start  # one block at a time
        for blk in blocks:
            start[(stage, blk.op, blk.micro_batch)] = blk
    for stage, m in itertools.product(range(S), range(M)):
        if stage > 0:
            assert start[(stage, "forward", m)].start >= start[(stage - 1, "forward", m)].end
        if stage < S - 1:
            assert start[(stage, "backward", m)].start >= start[(stage + 1, "backward", m)].end
    # a 3-time-unit forward on stage 1 is the bottleneck: it runs M forwards back to back at least
    assert timeline.makespan >= 1.0 + 5 * 3.0 + 1.0 + 2.0 + 0.5
    assert timeline.makespan == max(b.end for blocks in timeline.blocks for b in blocks)


def test_simulate_by_hand():
    # 1F1B, S=2, M=2, f=1, b=2. Stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7];
    # stage 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9].
    timeline = simulate(one_f_one_b(2, 2), 1.0, 2.0)
    spans = [[(str(Instruction(b.op, b.micro_batch)), b.start, b.end) for b in blocks if b.op != "update"]
             for blocks in timeline.blocks]
    assert spans == [[("F0", 0, 1), ("F1", 1, 2), ("B0", 4, 6), ("B1", 7, 9)],
                     [("F0", 1, 2), ("B0", 2, 4), ("F1", 4, 5), ("B1", 5, 7)]]
    assert timeline.makespan == 9.0
    assert timeline.bubble_fraction == pytest.approx((9 - 6 + 9 - 6) / 18)
    assert "makespan 9" in timeline.summary()


def test_instruction_strings_and_checks():
    assert str(Instruction("forward", 3)) == "F3"
    assert str(Instruction("backward", 3)) == "B3"
    assert str(Instruction("send_act", 3, 2)) == "send_act(3→2)"
    assert str(Instruction("recv_grad", 3, 2)) == "recv_grad(3←2)"
    assert str(Instruction("free", 3)) == "free(3)"
    assert str(Instruction("update")) == "update"
    assert Instruction("send_grad", 0, 1).kind == "grad" and Instruction("forward", 0).kind is None
    for bad in [("fwd", 0, None), ("forward", None, None), ("update", 0, None), ("send_act", 0, None),
                ("forward", 0, 1), ("forward", -1, None)]:
        with pytest.raises(ValueError):
            Instruction(*bad)
    with pytest.raises(ValueError, match="num_stages"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="num_micro_batches"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        make_schedule("interleaved", 2, 2)
    assert make_schedule("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert format_schedule(one_f_one_b(2, 2)) == "stage 0: F0 F1 B0 B1 update\nstage 1: F0 B0 F1 B1 update"


def _edit(schedule, stage, fn):
    out = [list(steps) for steps in schedule]
    out[stage] = fn(out[stage])
    return out


def _swap(steps, a, b):
    steps[a], steps[b] = steps[b], steps[a]
    return steps


def _index(steps, text):
    return [str(ins) for ins in steps].index(text)


def _swap_forwards(steps, a, b):
    """Swap the whole ``recv_act F send_act`` groups of micro-batches a and b (locally still legal)."""
    group = lambda m: [j for j, i in enumerate(steps) if i.op in ("recv_act", "forward", "send_act")  # noqa: E731
                       and i.micro_batch == m]
    ga, gb = group(a), group(b)
    for x, y in zip(ga, gb, strict=True):
        steps[x], steps[y] = steps[y], steps[x]
    return steps


# case → (how to break a 3-stage, 4-micro-batch schedule, what validate must say)
MALFORMED = {
    "backward before forward": (lambda s: _edit(s, 2, lambda st: [st[_index(st, "B0")]] + [
        i for i in st if str(i) != "B0"]), "backward of micro-batch 0 before its forward"),
    "missing update": (lambda s: _edit(s, 1, lambda st: st[:-1]), "missing the final 'update'"),
    "two updates": (lambda s: _edit(s, 1, lambda st: st[:2] + [Instruction("update")] + st[2:]),
                    "update must be the stage's last"),
    "unmatched send": (lambda s: _edit(s, 0, lambda st: st[:-1] + [Instruction("send_act", 0, 1), st[-1]]),
                       r"act channel 0→1: stage 0 sends micro-batches \[0, 1, 2, 3, 0\]"),
    "missing recv": (lambda s: _edit(s, 1, lambda st: [i for i in st if str(i) != "recv_grad(1←2)"]),
                     "backward of micro-batch 1 before recv_grad"),
    "recv after use": (lambda s: _edit(s, 1, lambda st: _swap(st, _index(st, "recv_act(0←0)"),
                                                                   _index(st, "recv_act(1←0)"))),
                       "forward of micro-batch 0 before recv_act"),
    "channel order": (lambda s: _edit(s, 1, lambda st: _swap_forwards(st, 0, 1)),
                      r"act channel 0→1: stage 0 sends micro-batches \[0, 1, 2, 3\], stage 1 receives \[1, 0"),
    "never freed": (lambda s: _edit(s, 0, lambda st: [i for i in st if str(i) != "free(2)"]),
                    r"micro-batches \[2\] never freed"),
    "free before backward": (lambda s: _edit(s, 0, lambda st: [Instruction("free", 0)] + [
        i for i in st if str(i) != "free(0)"]), "freed before its backward"),
    "recv_act on stage 0": (lambda s: _edit(s, 0, lambda st: [Instruction("recv_act", 0, 1)] + st),
                            "stage 0 has no recv_act"),
    "wrong peer": (lambda s: _edit(s, 0, lambda st: [Instruction("send_act", i.micro_batch, 2)
                                                     if i.op == "send_act" else i for i in st]),
                   "send_act on stage 0 is with stage 1"),
    "missing micro-batch": (lambda s: _edit(s, 2, lambda st: [i for i in st if i.micro_batch != 3]),
                            r"stage 2 forwards micro-batches \[0, 1, 2\]"),
}


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("case", MALFORMED)
def test_validate_rejects(name, case):
    schedule = BUILDERS[name](3, 4)
    validate(schedule)
    breaker, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        validate(breaker(schedule))


def test_deadlock_is_reported_by_simulate():
    # stage 0 waits for micro-batch 0's gradient before sending its activation
    bad = _edit(one_f_one_b(3, 4), 0,
                lambda st: _swap(st, _index(st, "send_act(0→1)"), _index(st, "recv_grad(0←1)")))
    with pytest.raises(ValueError, match="deadlocks: stage 0 waits at recv_grad"):
        simulate(bad, 1.0, 1.0)


def test_validate_finds_a_deadlock_that_local_checks_miss():
    # Channels carry the same micro-batches in the same order, every dependency is local-legal, but
    # stage 0 waits for B0's gradient before sending F1's activation, which stage 1 needs before B0.
    F, B = (lambda m: Instruction("forward", m)), (lambda m: Instruction("backward", m))
    stage0 = [F(0), Instruction("send_act", 0, 1), Instruction("recv_grad", 0, 1), B(0), Instruction("free", 0),
              F(1), Instruction("send_act", 1, 1), Instruction("recv_grad", 1, 1), B(1), Instruction("free", 1),
              Instruction("update")]
    stage1 = [Instruction("recv_act", 0, 0), F(0), Instruction("recv_act", 1, 0), F(1),
              B(0), Instruction("send_grad", 0, 0), Instruction("free", 0),
              B(1), Instruction("send_grad", 1, 0), Instruction("free", 1), Instruction("update")]
    with pytest.raises(ValueError, match="deadlocks: stage 0 waits at recv_grad"):
        validate([stage0, stage1])


# --- interleaved 1F1B and ZB-H1 (issue 12) ------------------------------------------------------------

# (G device groups, v chunks, M micro-batches): M a multiple of G, as interleaved 1F1B requires
INTERLEAVED = [(G, v, M) for G in (1, 2, 3, 4) for v in (1, 2, 3) for M in (G, 2 * G, 4 * G)]
ZB = [(S, M) for S in range(1, 6) for M in range(1, 11)]


def _dependencies_hold(schedule, split):
    """Every micro-batch's F → B (→ W) → free on each stage, and across stages F(s-1) → F(s), B(s+1) → B(s),
    read off the per-stage lists and the simulated start/end times."""
    stages = stage_lists(schedule)
    N, M = len(stages), len(compute_order(stages[0], "forward"))
    backward = "backward_input" if split else "backward"
    for stage, steps in enumerate(stages):
        position = {(ins.op, ins.micro_batch): j for j, ins in enumerate(steps)}
        for m in range(M):
            chain = ["forward", backward] + (["backward_weight"] if split else []) + ["free"]
            assert [position[(op, m)] for op in chain] == sorted(position[(op, m)] for op in chain)
    timeline = simulate(schedule, 1.0, 2.0)
    when = {(b.stage, b.op, b.micro_batch): b for blocks in timeline.blocks for b in blocks}
    for stage in range(N):
        for m in range(M):
            if stage > 0:
                assert when[(stage, "forward", m)].start >= when[(stage - 1, "forward", m)].end
            if stage < N - 1:
                assert when[(stage, backward, m)].start >= when[(stage + 1, backward, m)].end
            if split:
                assert when[(stage, "backward_weight", m)].start >= when[(stage, backward, m)].end


@pytest.mark.parametrize("G,v,M", INTERLEAVED, ids=[f"G{G}-v{v}-M{M}" for G, v, M in INTERLEAVED])
def test_interleaved_is_valid_and_as_fast_as_its_formula(G, v, M):
    schedule = interleaved_one_f_one_b(G, M, v)
    validate(schedule)
    assert len(schedule) == G and len(stage_lists(schedule)) == G * v
    for group, steps in enumerate(schedule):
        assert {ins.stage % G for ins in steps if ins.op != "update"} == {group}
    _dependencies_hold(schedule, split=False)
    logs = run_threaded(schedule)
    if G * v > 1:
        assert [val for kind, m, val in logs[G * v - 1] if kind == "act"] == [m + G * v - 2 for m in range(M)]
    # v chunks of a stage costing f/v, b/v each: (M + (G-1)/v)(f+b), bubble (G-1)/(vM+G-1)
    for f, b in [(1.0, 2.0), (1.0, 1.0)]:
        timeline = simulate(schedule, f / v, b / v)
        assert timeline.makespan == pytest.approx((M + (G - 1) / v) * (f + b))
        assert timeline.bubble_fraction == pytest.approx((G - 1) / (v * M + G - 1))
    assert max_in_flight(schedule) == [min(2 * (G - r - 1) + (v - 1) * G + 1, v * M) if v > 1 else min(G - r, M)
                                       for r in range(G)]
    if v == 1:  # one chunk per group is 1F1B, instruction for instruction
        assert [[dataclasses.replace(i, stage=None) for i in steps] for steps in schedule] == one_f_one_b(G, M)


@pytest.mark.parametrize("S,M", ZB, ids=[f"S{S}-M{M}" for S, M in ZB])
def test_zb_h1_is_valid_and_as_fast_as_its_formula(S, M):
    schedule = zb_h1(S, M)
    validate(schedule)
    for stage, steps in enumerate(schedule):
        assert "backward" not in {ins.op for ins in steps}
        # 1F1B's order of forwards and input-gradient backwards, the W's in between
        fb = [(str(ins)[0], ins.micro_batch) for ins in steps if ins.op in ("forward", "backward_input")]
        ref = [(str(ins)[0], ins.micro_batch) for ins in one_f_one_b(S, M)[stage] if ins.op in ("forward", "backward")]
        assert fb == ref
        assert compute_order(steps, "backward_weight") == list(range(M))
    _dependencies_hold(schedule, split=True)
    run_threaded(schedule)
    assert max_in_flight(schedule) == [min(S, M)] * S  # 1F1B's most (its first stage's)
    # f = b_in = w = 1 (the fused backward b = 2): 3M + S - 1 for M ≥ S, never slower than 1F1B
    timeline = simulate(schedule, 1.0, 2.0, weight_time=1.0)
    ref = simulate(one_f_one_b(S, M), 1.0, 2.0)
    assert timeline.makespan <= ref.makespan
    if M >= S:
        assert timeline.makespan == pytest.approx(3 * M + S - 1)
        assert timeline.bubble_fraction == pytest.approx((S - 1) / (3 * M + S - 1))
    if S > 1 and M > 1:
        assert timeline.bubble_fraction < ref.bubble_fraction


def test_four_stages_eight_micro_batches_bubbles():
    """The acceptance case: on 4 stages × 8 micro-batches both new schedules beat 1F1B's bubble (2/11 = 27.3%)."""
    one = simulate(one_f_one_b(4, 8), 1.0, 2.0).bubble_fraction
    inter = simulate(interleaved_one_f_one_b(4, 8, 2), 0.5, 1.0).bubble_fraction
    zb = simulate(zb_h1(4, 8), 1.0, 2.0).bubble_fraction
    assert one == pytest.approx(3 / 11) and inter == pytest.approx(3 / 19) and zb == pytest.approx(3 / 27)


def test_make_schedule_new_names_and_device_groups():
    assert make_schedule("zb_h1", 3, 4) == zb_h1(3, 4)
    assert make_schedule("interleaved_1f1b", 8, 8, virtual_stages=2) == interleaved_one_f_one_b(4, 8, 2)
    with pytest.raises(ValueError, match="multiple of the number of device groups"):
        make_schedule("interleaved_1f1b", 8, 6, virtual_stages=2)
    with pytest.raises(ValueError, match="do not split"):
        make_schedule("interleaved_1f1b", 6, 8, virtual_stages=4)
    with pytest.raises(ValueError, match="needs schedule 'interleaved_1f1b'"):
        make_schedule("1f1b", 4, 8, virtual_stages=2)
    assert num_device_groups([[0, 1], [2, 3], [0, 1], [2, 3]]) == 2
    assert num_device_groups([[0], [1], [2]]) == 3
    with pytest.raises(ValueError, match="disjoint device groups"):
        num_device_groups([[0, 1], [1, 2], [0, 1], [1, 2]])
    with pytest.raises(ValueError, match="stage s mod 2"):
        num_device_groups([[0], [1], [0], [2]])
    assert str(Instruction("backward_weight", 2, stage=5)) == "W2@5"
    assert str(Instruction("backward_input", 2)) == "B2"
    assert format_schedule(interleaved_one_f_one_b(2, 2, 2)).startswith("group 0: F0@0 F1@0 F0@2 F1@2 B0@2")


def _remove(steps, text):
    return [i for i in steps if str(i) != text]


SPLIT_MALFORMED = {
    "W before B": (lambda s: _edit(s, 1, lambda st: _swap(st, _index(st, "B0"), _index(st, "W0"))),
                   "backward_weight of micro-batch 0 needs exactly one backward_input"),
    "free before W": (lambda s: _edit(s, 2, lambda st: _swap(st, _index(st, "W1"), _index(st, "free(1)"))),
                      "freed before its backward"),
    "W missing": (lambda s: _edit(s, 0, lambda st: _remove(_remove(st, "W3"), "free(3)")),
                  r"update before the backward of micro-batches \[3\]"),
    "send_grad before B": (lambda s: _edit(s, 1, lambda st: _swap(st, _index(st, "B2"), _index(st, "send_grad(2→0)"))),
                           "gradient of micro-batch 2 sent before its backward"),
}


@pytest.mark.parametrize("case", SPLIT_MALFORMED)
def test_validate_rejects_broken_split_backwards(case):
    schedule = zb_h1(3, 4)
    breaker, message = SPLIT_MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        validate(breaker(schedule))


def test_validate_rejects_a_chunk_on_the_wrong_group():
    schedule = interleaved_one_f_one_b(2, 2, 2)
    moved = [list(steps) for steps in schedule]
    moved[0] = [dataclasses.replace(i, stage=1) if i.stage == 0 and i.op == "forward" else i for i in moved[0]]
    with pytest.raises(ValueError, match="belongs on list 1"):
        validate(moved)
