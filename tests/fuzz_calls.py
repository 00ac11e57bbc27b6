"""Seeded random calls of the public API with one argument broken, run by tests/test_fuzz.py in a subprocess
(``python -m tests.fuzz_calls SEED COUNT``) so that a crash shows up as a failed test, not a dead run.

Each call starts from valid arguments, breaks one (dtype, rank, size, an out-of-range value, a non-tensor, a
bad scalar) and prints one JSON line: ``start`` before the call (the last one names a crash), then the outcome:
``ok`` with the output shape, or the error type and message. The test checks that errors are ValueError or
TypeError and name the broken argument, and that calls with a value-level change of floats (NaN) either run
or fail that way.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import sys

import torch

import sptr
from sptr.layers import SphereFormerConfig, VarLengthMultiheadSAConfig
from sptr.ops import RelativePosition, quantised_coords, window_attention
from sptr.ops.step_attention import aggregate, pair_logits, segment_softmax


@dataclasses.dataclass
class Call:
    op: str
    args: dict
    broken: str = ""
    names: tuple = ()        # fragments one of which an error about `broken` must contain
    must_fail: bool = True


def _attention_args(rng: random.Random) -> dict:
    counts = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    n, h, d = sum(counts), rng.randint(1, 3), rng.choice([1, 4, 16])
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    coords = torch.randint(0, 2, (n, 3), generator=gen, dtype=torch.int32)
    table = torch.randn(3, 3, h, d, generator=gen)
    return dict(q=q, k=k, v=v, window_offsets=offsets, coords=coords, query_table=table, key_table=table.clone(),
                value_table=table.clone(), rel_shift=1, radius=None, radial_a=0.0, scale=None)


def _run_attention(a: dict):
    rel_pos = RelativePosition(a["coords"], a["rel_shift"], a["query_table"], a["key_table"], a["value_table"],
                               a["radius"], a["radial_a"])
    return window_attention(a["q"], a["k"], a["v"], a["window_offsets"], rel_pos=rel_pos, scale=a["scale"])


def _pair_args(rng: random.Random) -> dict:
    a = _attention_args(rng)
    counts = (a["window_offsets"][1:] - a["window_offsets"][:-1]).long()
    n = int(counts.sum())
    o0, _, i0, i1 = sptr.precompute_all(n, counts.numel(), 0, counts)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    rel = torch.randint(0, 3, (i0.numel(), 3), generator=gen, dtype=torch.int32)
    return dict(q=a["q"], k=a["k"], v=a["v"], index_0=i0, index_1=i1, index_0_offsets=o0, rel_idx=rel,
                table=a["query_table"])


def _run_pairs(a: dict):
    logits = pair_logits(a["q"], a["k"], a["index_0"], a["index_1"], a["table"], a["table"], a["rel_idx"])
    attn = segment_softmax(logits, a["index_0_offsets"])
    return aggregate(attn, a["v"], a["index_0_offsets"], a["index_1"], a["table"], a["rel_idx"])


def _window_args(rng: random.Random) -> dict:
    n = rng.randint(1, 30)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return dict(xyz=torch.rand(n, 3, generator=gen) * 2, batch=torch.zeros(n, dtype=torch.long),
                window_size=rng.choice([0.3, 0.5, (0.4, 0.4, 1.0)]), quant_size=0.1)


def _run_windows(a: dict):
    sptr.get_indices_params(a["xyz"], a["batch"], a["window_size"], False)
    return quantised_coords(a["xyz"], a["window_size"], a["quant_size"], True)


OPS = {"window_attention": (_attention_args, _run_attention), "step_ops": (_pair_args, _run_pairs),
       "windowing": (_window_args, _run_windows)}
INDEX_ARGS = {"window_offsets", "coords", "index_0", "index_1", "index_0_offsets", "rel_idx", "batch"}
SCALARS = {"rel_shift": [1.5, -1, "1", True], "radial_a": [math.nan], "scale": [math.nan, "x", math.inf],
           "window_size": [0.0, -1.0, math.nan, (1.0, 1.0)], "quant_size": [0.0, math.inf, "a"]}
# How errors may name an argument (the wrappers prefix the rel_pos fields; mixed dtypes name the group).
ALIASES = {"coords": ("rel_pos.coords",), "query_table": ("rel_pos.query_table", "rel_pos tables"),
           "key_table": ("rel_pos.key_table", "rel_pos tables"),
           "value_table": ("rel_pos.value_table", "rel_pos tables"), "rel_shift": ("rel_pos.rel_shift",),
           "radial_a": ("rel_pos.radial_a",), "index_0_offsets": ("index_0_offsets", "indptr"),  # the softmax's name
           "table": ("table", "table_q", "table_k")}


def _break_tensor(rng: random.Random, name: str, t: torch.Tensor):
    """(new value, must_fail) for one way of breaking tensor argument `name`. A size change may be legal (a
    longer table, more key rows than queries), so it need not fail; a NaN need not fail except in xyz."""
    kinds = ["dtype", "rank", "size", "not_a_tensor"] + (["value"] if name in INDEX_ARGS else ["nan"])
    kind = rng.choice(kinds)
    if kind == "dtype":
        if name in INDEX_ARGS:
            return t.to(rng.choice([torch.float32, torch.uint8, torch.bool])), name != "batch"
        dtype = rng.choice([torch.int32, torch.float64, torch.complex64])
        return t.to(dtype), not (name == "xyz" and dtype == torch.float64)  # xyz alone may be float64
    if kind == "rank":
        return t.unsqueeze(-1), True
    if kind == "size":
        if t.dim() == 0 or t.numel() == 0:
            return t.unsqueeze(0), True
        dim = rng.randrange(t.dim())
        sizes = list(t.shape)
        sizes[dim] += 1
        return torch.zeros(sizes, dtype=t.dtype), False
    if kind == "not_a_tensor":
        return t.tolist(), True
    if kind == "nan":
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = math.nan
        return t, name == "xyz"
    t = t.clone()
    flat = t.view(-1)
    flat[rng.randrange(flat.numel())] = rng.choice([-1, 1 << 20])
    return t, name != "batch"  # any integer is a batch id


def make_call(rng: random.Random, index: int) -> Call:
    op = rng.choice(sorted(OPS))
    args = OPS[op][0](rng)
    if index % 10 == 0:  # a valid call now and then: it must run
        return Call(op, args, must_fail=False)
    name = rng.choice([k for k, v in args.items() if isinstance(v, torch.Tensor) or k in SCALARS])
    if name in SCALARS and (not isinstance(args[name], torch.Tensor) or rng.random() < 0.5):
        args[name] = rng.choice(SCALARS[name])
        if name == "radial_a":
            args["radius"] = torch.ones(args["q"].shape[0])
        must_fail = True
    else:
        args[name], must_fail = _break_tensor(rng, name, args[name])
    return Call(op, args, name, ALIASES.get(name, (name,)), must_fail)


CONFIG_FIELDS = [(SphereFormerConfig, {}), (VarLengthMultiheadSAConfig, dict(embed_dim=16, num_heads=2,
                                                                              indice_key="k"))]
BAD_VALUES = ["x", -1, 0, 1.5, math.nan, None, True, [1], (0.0, 0.3, 0.3)]


def config_calls(rng: random.Random, count: int):
    """Configs built with one field replaced by a random bad value: either accepted (the value is valid for that
    field) or a ValueError/TypeError naming ``Config.field``."""
    for _ in range(count):
        cls, base = rng.choice(CONFIG_FIELDS)
        field = rng.choice([f.name for f in dataclasses.fields(cls)])
        value = rng.choice(BAD_VALUES)
        try:
            cls(**(base | {field: value}))
            yield dict(kind="config", cls=cls.__name__, field=field, value=repr(value), outcome="ok")
        except Exception as e:  # noqa: BLE001 (reported to the parent test)
            yield dict(kind="config", cls=cls.__name__, field=field, value=repr(value), outcome="error",
                       type=type(e).__name__, message=str(e))


def main(seed: int, count: int) -> None:
    rng = random.Random(seed)
    for i in range(count):
        call = make_call(rng, i)
        print(json.dumps(dict(start=i, op=call.op, broken=call.broken)), flush=True)
        record = dict(kind="call", index=i, op=call.op, broken=call.broken, names=call.names,
                      must_fail=call.must_fail)
        try:
            out = OPS[call.op][1](call.args)
            record.update(outcome="ok", shape=list(out.shape))
        except Exception as e:  # noqa: BLE001 (reported to the parent test)
            record.update(outcome="error", type=type(e).__name__, message=str(e))
        print(json.dumps(record), flush=True)
    for record in config_calls(rng, count // 2):
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
