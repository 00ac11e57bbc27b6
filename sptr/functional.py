"""SparseTransformer-compatible functional module (``from sptr.functional import attention_step1``).

Set ``sptr.functional.DEBUG = True`` to synchronise after each op and print its time.
"""
import functools
import time

import torch

from .ops import step_attention as _wa

DEBUG = False


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not DEBUG:
            return fn(*args, **kwargs)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        print(f"sptr.{fn.__name__}: {(time.perf_counter() - t0) * 1e3:.3f} ms")
        return out

    return wrapper


precompute_all = _timed(_wa.precompute_all)
attention_step1 = _timed(_wa.attention_step1)
attention_step2 = _timed(_wa.attention_step2)
dot_prod_with_idx = _timed(_wa.dot_prod_with_idx)
dot_prod_with_idx_all = _timed(_wa.dot_prod_with_idx_all)
attention_step2_with_rel_pos_value = _timed(_wa.attention_step2_with_rel_pos_value)


def _function_class(name, fn):
    """The published autograd.Function classes are only ever used through ``.apply``."""
    return type(name, (), {"apply": staticmethod(fn), "__doc__": fn.__doc__})


PrecomputeAll = _function_class("PrecomputeAll", precompute_all)
AttentionStep1 = _function_class("AttentionStep1", attention_step1)
AttentionStep2 = _function_class("AttentionStep2", attention_step2)
DotProdWithIdx = _function_class("DotProdWithIdx", dot_prod_with_idx)
DotProdWithIdxAll = _function_class("DotProdWithIdxAll", dot_prod_with_idx_all)
AttentionStep2WithRelPosValue = _function_class("AttentionStep2WithRelPosValue", attention_step2_with_rel_pos_value)
