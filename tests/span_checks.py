"""Checks of a round span's times, shared by the unit and the system tests of tracing."""


def check_round_times(a: dict) -> None:
    """A round span's attributes: the transport and network times as docs/glossary.md
    defines them."""
    # The target reports its whole time on the proposal: the round trip less it is the transport.
    assert (
        a["specdec.target_handled_ns"]
        >= a["specdec.target_compute_ns"] + a["specdec.target_host_ns"]
    )
    assert a["specdec.transport_ns"] == max(
        0, a["specdec.verify_ns"] - a["specdec.target_handled_ns"]
    )
    # the network time: the round trip less the target's pass
    assert a["specdec.network_ns"] == max(
        0, a["specdec.verify_ns"] - a["specdec.target_compute_ns"]
    )
