"""Pipeline parallelism (gtmpi.pipeline): the schedules' orders, and the GPT cut into stages on
two workers (two each, interleaved) giving the full batch's loss and gradients, with exactly
one transfer per micro-batch and crossing each way and nothing else, in strict placement."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import gtmpi
from gtmpi.pipeline import Pipeline, bubble, issue_order, makespan, worker_of

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.gpt.model import SIZES, balanced_bounds, build, stages  # noqa: E402

WORKERS = sorted(gtmpi.info()["workers"])
spread = pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")


def _every_action_once_after_what_it_needs(order: list, stages: int, m: int,
                                            kinds: str = "FB") -> None:
    assert sorted(order) == sorted((k, s, i) for k in kinds for s in range(stages)
                                   for i in range(m))
    seen = set()
    for kind, s, i in order:
        if kind == "F" and s:
            assert ("F", s - 1, i) in seen
        if kind == "B":
            assert ("F", s, i) in seen and (s == stages - 1 or ("B", s + 1, i) in seen)
        if kind == "W":
            assert ("B", s, i) in seen
        seen.add((kind, s, i))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (4, 8), (4, 3)])
def test_schedule_orders_every_action_once_after_what_it_needs(name, p, m):
    order = issue_order(name, p, m)
    _every_action_once_after_what_it_needs(order, p, m)
    for s in range(p):
        mine = [(k, i) for k, t, i in order if t == s]
        alive = peak = 0  # micro-batches whose forward ran and backward has not
        for k, _ in mine:
            alive += 1 if k == "F" else -1
            peak = max(peak, alive)
        if name == "gpipe":
            assert mine == [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            assert peak == m
        else:  # 1F1B: p - s - 1 forwards to fill, then one of each in turn
            warm = min(p - s - 1, m)
            assert mine[:warm] == [("F", i) for i in range(warm)]
            if m > warm:
                assert mine[warm:warm + 2] == [("F", warm), ("B", 0)]
            assert peak == min(p - s, m)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_zero_bubble_h1_orders_b_and_w_apart_and_fills_the_bubble(p, m):
    """ZB-H1: every forward, input-gradient (B) and weight-gradient (W) action once, after what
    it needs; at most p micro-batches held on any stage from F to W (W reads activations too:
    1F1B's first stage's memory); and with F, B and W of equal cost a shorter step than
    1F1B's (whose backward is B and W together)."""
    order = issue_order("zbh1", p, m)
    _every_action_once_after_what_it_needs(order, p, m, "FBW")
    for s in range(p):
        alive = peak = 0
        for k, t, _ in order:
            if t == s and k != "B":
                alive += 1 if k == "F" else -1
                peak = max(peak, alive)
        assert peak <= min(p, m)
    zb = makespan(order, p, {"F": 1, "B": 1, "W": 1})
    one = makespan(issue_order("1f1b", p, m), p, {"F": 1, "B": 2})
    ideal = 3 * m
    if p > 1 and m >= p:  # the bubble (time idle per stage) below 1F1B's, at p=2 a third
        assert zb - ideal < one - ideal, (zb, one, ideal)
    if p == 2 and m >= p:
        assert zb - ideal <= (one - ideal) / 3, (zb, one, ideal)
    assert zb <= one and bubble(p, m, "zbh1") == pytest.approx(1 - ideal / zb)


@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_zero_bubble_v_lays_chunks_in_a_v_and_beats_zbh1(p, m):
    """ZB-V: 2p chunks, chunk c and 2p - 1 - c on worker c; every F, B and W once after what
    it needs; at most 2p chunks' micro-batches held per worker from F to W (p of a whole
    stage, the memory of 1F1B's first stage); a bubble below ZB-H1's, 0.077 at p=4, m=8 (the
    zero bubble paper's 0.059 for equal F, B and W holds more W's than that)."""
    assert [worker_of("zbv", c, p) for c in range(2 * p)] == [*range(p), *reversed(range(p))]
    order = issue_order("zbv", p, m)
    _every_action_once_after_what_it_needs(order, 2 * p, m, "FBW")
    for w in range(p):
        alive = peak = 0
        for k, c, _ in order:
            if worker_of("zbv", c, p) == w and k != "B":
                alive += 1 if k == "F" else -1
                peak = max(peak, alive)
        assert peak <= 2 * p
    assert bubble(p, m, "zbv") <= bubble(p, m, "zbh1")
    if (p, m) == (4, 8):
        assert bubble(p, m, "zbv") == pytest.approx(1 - 24 / 26)  # 2 ticks idle in 26
    with pytest.raises(ValueError, match=r"zbv stages: chunk c goes in a V"):
        Pipeline([lambda x: x] * 3 + [lambda x, y: x], ["a", "b", "a", "b"], 2, "zbv")


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3)])
def test_interleaved_orders_chunks_megatrons_way_and_shrinks_the_bubble(p, m, v):
    """Megatron's interleaved 1F1B: stage j * p + r is chunk j of worker r; every action once
    after what it needs; worker r warms up with (p - r - 1) * 2 + (v - 1) * p forwards; and
    the bubble is Megatron's (p - 1) / (v m + p - 1), 1F1B's over v."""
    order = issue_order("interleaved", p, m, v)
    _every_action_once_after_what_it_needs(order, p * v, m)
    for r in range(p):
        mine = [k for k, s, _ in order if s % p == r]
        warm = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        assert mine[:warm] == ["F"] * warm and (warm == m * v or mine[warm:warm + 2] == ["F", "B"])
    assert bubble(p, m, "interleaved", v) == pytest.approx((p - 1) / (v * m + p - 1))
    with pytest.raises(ValueError, match="a multiple of the stages"):
        issue_order("interleaved", 4, 6, 2)


def test_bubble_and_bad_arguments():
    assert bubble(4, 8) == bubble(4, 8, "gpipe") == pytest.approx(3 / 11)
    assert bubble(2, 8, "zbh1") == pytest.approx(1 / 25)  # 1F1B's: 1/9
    assert bubble(4, 8, "zbh1") == pytest.approx(5 / 29)  # 1F1B's: 3/11
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        issue_order("zb", 2, 2)
    with pytest.raises(ValueError, match="2 stages need as many signals, got 1"):
        Pipeline([lambda x: x, lambda x, y: x], ["a"], micro_batches=2)
    with pytest.raises(ValueError, match="micro_batches must be positive"):
        Pipeline([lambda x, y: x], ["a"], micro_batches=0)
    with pytest.raises(ValueError, match="a batch of 6 does not cut into 4 equal micro-batches"):
        Pipeline([lambda x, y: x], ["a"], micro_batches=4).step(torch.zeros(6, 2), torch.zeros(6))


@spread
@pytest.mark.parametrize("name,layers", [("gpipe", 4), ("1f1b", 4), ("zbh1", 4),
                                         ("interleaved", 4), ("zbv", 4), ("1f1b", 1)])
def test_two_stage_gpt_gives_the_full_batch_loss_and_gradients(name, layers):
    """Two workers; interleaved: each holds two chunks of the model (chunks 0 and 2 the first,
    1 and 3 the second), so every micro-batch crosses between them three times each way; ZB-V:
    chunks 0 and 3 the first, 1 and 2 the second, so twice (the loss is on the first). One
    block: the last stage runs the norm, the head and the loss alone."""
    chunks = 4 if name in ("interleaved", "zbv") else 2
    where = [f"stage{worker_of(name, s, 2)}" for s in range(chunks)]
    c = dataclasses.replace(SIZES["tiny"], layers=layers)
    gtmpi.load_config({"stage0": {"shard": {"workers": [0]}},
                       "stage1": {"shard": {"workers": [1]}}})
    torch.manual_seed(0)
    ref = build(torch)(c)
    gen = torch.Generator().manual_seed(1)
    m = 4
    model = build(gtmpi)(c)
    model.load_state_dict(ref.state_dict())
    parts = stages(model, chunks)
    if layers == 1:
        assert parts[-1][0] == [model.ln, model.head]
    for s, (owned, _) in enumerate(parts):
        for module in owned:
            gtmpi.signal.place(module, where[s])
    pipe = Pipeline([run for _, run in parts], where,
                    micro_batches=m, schedule=name)
    opt, topt = gtmpi.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())
    gtmpi.debug.strict_placement()
    try:
        for _ in range(2):  # a second step: the optimizer ran on each stage's own workers
            data = torch.randint(0, c.vocab, (8, c.seq + 1), generator=gen)
            x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
            before = {r: dict(s["collectives"]) for r, s in gtmpi.debug.worker_stats().items()}
            opt.zero_grad()
            loss = pipe.step(x, y)
            got = loss.item()
            topt.zero_grad()
            want = ref(x, y)
            want.backward()
            assert abs(got - want.item()) < 1e-5
            for (key, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.cpu_torch(), q.grad, rtol=1e-4, atol=1e-6,
                                           msg=key)
            after = gtmpi.debug.worker_stats()
            moved = {r: {k: v[0] - before[r].get(k, (0, 0))[0] for k, v in s["collectives"].items()
                         if v[0] != before[r].get(k, (0, 0))[0]} for r, s in after.items()}
            first, second = WORKERS[:2]
            # an activation forward and a gradient back per micro-batch and crossing, nothing
            # else (interleaved: the first sends chunks 0 and 2's outputs and chunk 2's input's
            # gradient; the second chunk 1's output and chunks 1 and 3's inputs' gradients)
            crossings = m * sum(a != b for a, b in zip(where, where[1:]))
            assert moved[first] == moved[second] == {"send": crossings, "recv": crossings}, \
                moved
            opt.step()
            topt.step()
    finally:
        gtmpi.debug.strict_placement(False)
    last = WORKERS[0] if name == "zbv" else WORKERS[1]
    for weight, worker in ((model.tokens.weight, WORKERS[0]), (model.head.weight, last)):
        assert gtmpi.debug.placement(weight)["mesh"] == [worker]


def test_a_split_backward_runs_a_fused_kernel_once(monkeypatch):
    """ZB's B and W: a layer norm's one backward kernel makes its input's and its weights'
    gradients together, so B keeps the weights' for W instead of W running it again (on an
    H200 the second run cost a ZB-V stage 7% more GPU time); the gradients are torch's."""
    from gtmpi.autograd import engine, grads
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    model = gtmpi.nn.Sequential(gtmpi.nn.Linear(6, 8), gtmpi.nn.LayerNorm(8),
                                gtmpi.nn.Linear(8, 3))
    model.load_state_dict(ref.state_dict())
    data = torch.randn(5, 6)
    issued = []
    plain = grads.apply
    monkeypatch.setattr(grads, "apply", lambda name, *a, **k: issued.append(name) or
                        plain(name, *a, **k))
    x = gtmpi.tensor(data).requires_grad_()
    later = engine.backward_inputs(model(x).square().sum(), None, [x])
    assert issued.count("layer_norm_grad") == 1 and model[1].weight.grad is None
    later.run()
    assert issued.count("layer_norm_grad") == 1
    tx = data.clone().requires_grad_()
    ref(tx).square().sum().backward()
    torch.testing.assert_close(x.grad.cpu_torch(), tx.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu_torch(), q.grad, rtol=1e-5, atol=1e-6)


def test_stages_are_cut_by_cost_per_worker():
    """GPT-2 small's head and loss cost about 3.7 blocks (kernel profiles on H200s): PP=2 cuts
    8/4, not 6/6 by count; with two chunks per worker the workers', not the chunks', costs are
    evened (interleaved: chunks 0 and 2 on the first worker hold 8 blocks, 1 and 3 hold 4 and
    the head; cut as four equal-cost chunks, 7 and 5)."""
    c = SIZES["gpt2"]
    assert balanced_bounds(c, 2) == [0, 8, 12]
    assert balanced_bounds(c, 1) == [0, 12]
    # PP=4: the head alone costs nearly a stage's share (3.7 of 4 blocks): 3/4/4/1 would
    # leave the last stage 4.7 blocks' worth
    assert balanced_bounds(c, 4) == [0, 4, 8, 12, 12]
    for name in ("interleaved", "zbv"):
        bounds = balanced_bounds(c, 4, lambda k: worker_of(name, k, 2))
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        first = sum(n for k, n in enumerate(sizes) if worker_of(name, k, 2) == 0)
        assert first == (8 if name == "interleaved" else 4), sizes  # ZB-V: the head is there
    deep = dataclasses.replace(c, layers=48)  # past the exhaustive search's reach
    bounds = balanced_bounds(deep, 16, lambda k: worker_of("interleaved", k, 8))
    assert len(bounds) == 17 and all(b > a for a, b in zip(bounds, bounds[1:-1]))
    with pytest.raises(ValueError, match="12 blocks cannot make 14 stages"):
        balanced_bounds(c, 14)
