"""The sampler keeps a step on the device: what crosses to the host is the token ids and the
logprobs asked for, never a vocabulary-sized row (issue 16: ``probs.cpu()`` copied ~600 KB
per slot per step at a 150k vocabulary, and synced once per row)."""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pantheon.core.protocol import SamplingParams
from workers.sampler import SamplerState, sample

V = 4096
HOST = {"cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"}


class HostCopies(TorchFunctionMode):
    """Records every call that hands a tensor's values to Python or to the host."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST and args and isinstance(args[0], torch.Tensor):
            self.calls.append((name, args[0].numel()))
        if name == "to" and args and isinstance(args[0], torch.Tensor) and "cpu" in repr(args[1:]):
            self.calls.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


def _states(params):
    return [SamplerState.create(p, [0], torch.device("cpu")) for p in params]


def test_a_sampled_batch_copies_back_token_ids_only():
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=8) for i in range(6)
    ] + [SamplingParams(temperature=0.0)] * 2
    logits = torch.randn(len(params), V)
    with HostCopies() as mode:
        out = sample(logits, _states(params), [[1, 2, 3]] * len(params), [0] * len(params))
    assert len(out) == 8 and all(0 <= s.token < V for s in out)
    assert mode.calls == [("tolist", 8)]  # one copy of B ids: no [V] row, no sync per row


def test_logprobs_come_back_for_the_rows_that_asked_only():
    params = [
        SamplingParams(temperature=1.0, seed=1, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.0, seed=2),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    logits = torch.randn(3, V)
    with HostCopies() as mode:
        out = sample(logits, _states(params), [[], [], []], [0, 0, 0])
    assert mode.calls and all(n <= 3 * 2 for _, n in mode.calls), mode.calls  # ids, 2 chosen, 2x3 top
    raw = torch.log_softmax(logits, dim=-1)
    top = out[0].top
    assert out[0].logprob == raw[0, out[0].token].item() and top is not None and len(top) == 3
    assert top[0][0] == int(torch.argmax(raw[0]))
    assert out[1].logprob is None and out[1].top is None
    assert out[2].token == int(torch.argmax(logits[2])) and out[2].top is None
    assert out[2].logprob == raw[2, out[2].token].item()


def test_the_generator_lives_on_the_logits_device():
    st = SamplerState.create(SamplingParams(seed=3), [], torch.device("cpu"))
    assert st.generator.device.type == "cpu"


def test_a_seed_draws_the_same_tokens_whatever_shares_the_batch():
    p = SamplingParams(temperature=1.0, seed=42)
    row = torch.randn(1, V)
    alone = [sample(row, _states([p]), [[]], [0])[0].token]
    other = SamplingParams(temperature=1.0, seed=7)
    mixed = sample(torch.cat([torch.randn(1, V), row]), _states([other, p]), [[], []], [0, 0])
    assert mixed[1].token == alone[0]


def test_logit_bias_moves_the_pick():
    logits = torch.zeros(1, V)
    logits[0, 10] = 5.0
    p = SamplingParams(temperature=0.0, logit_bias={20: 100.0, 10: -100.0})
    assert sample(logits, _states([p]), [[]], [0])[0].token == 20
    banned = SamplingParams(temperature=1.0, seed=1, logit_bias={i: -100.0 for i in range(V - 1)})
    assert sample(torch.zeros(1, V), _states([banned]), [[]], [0])[0].token == V - 1


def test_greedy_rows_with_nothing_to_penalize_take_one_argmax_for_the_batch():
    """Plain greedy rows skip the per-row copy and argmax (issue 28 §2: ops per step), picking
    the first maximum as before; a greedy row with a penalty or a mask still gets it."""
    logits = torch.randn(4, V)
    logits[1, 7] = logits[1, 9] = 50.0  # a tie: the first maximum wins
    logits[2, 0] = 60.0  # row 2 is under min_tokens: its stop id (0) is masked
    logits[3, 5], logits[3, 6] = 70.0, 40.0  # row 3 repeats 5: penalised to 35, 6 wins
    greedy = SamplingParams(temperature=0.0)
    params = [
        greedy,
        greedy,
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ]
    out = sample(logits.clone(), _states(params), [[], [], [], [5]], [0, 0, 0, 0])
    masked = logits[2].clone()
    masked[0] = float("-inf")
    assert [s.token for s in out] == [int(torch.argmax(logits[0])), 7, int(torch.argmax(masked)), 6]

    class Argmaxes(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Argmaxes.n += func.overloadpacket.__name__ == "argmax"
            return func(*args, **(kwargs or {}))

    with Argmaxes():
        out = sample(logits[:2].clone(), _states([greedy, greedy]), [[1], [2]], [0, 0])
    assert [s.token for s in out] == [int(torch.argmax(logits[0])), 7] and Argmaxes.n == 1
