"""orchestrator.tokenizer: the target's tokenizer, loaded at the first call, joins what
start-up froze out of the garbage collector's reach, where start-up froze it."""

import gc

from orchestrator.tokenizer import TargetTokenizer
from speculative.loading import TINY_PREFIX


def _walked_by_a_full_collection(obj) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_a_tokenizer_loaded_after_start_up_is_frozen_with_it():
    gc.freeze()  # as serve_until_signalled does
    try:
        tokenizer = TargetTokenizer(pool=None, name=TINY_PREFIX).get()
        assert not _walked_by_a_full_collection(tokenizer)
    finally:
        gc.unfreeze()  # this test process goes on creating and dropping models


def test_nothing_is_frozen_where_start_up_froze_nothing():
    assert gc.get_freeze_count() == 0
    tokenizer = TargetTokenizer(pool=None, name=TINY_PREFIX).get()
    assert gc.get_freeze_count() == 0
    assert _walked_by_a_full_collection(tokenizer)
