"""service_common.server: what every service process does around its gRPC server."""

import gc

from service_common.server import freeze_startup_heap


def _walked_by_a_full_collection(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # the generations a collection walks


def test_what_start_up_built_is_out_of_the_collectors_reach():
    built_at_start_up = [object()]
    assert _walked_by_a_full_collection(built_at_start_up)
    try:
        freeze_startup_heap()
        made_later = [object()]
        assert not _walked_by_a_full_collection(built_at_start_up)
        assert _walked_by_a_full_collection(made_later)
    finally:
        gc.unfreeze()  # this test process goes on creating and dropping models
    assert _walked_by_a_full_collection(built_at_start_up)
