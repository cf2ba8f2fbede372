"""The check that a document's shown outputs are what a run printed (tests/shown_outputs.py)."""

import pytest

from tests.shown_outputs import assert_shows, normalise


def test_values_that_differ_between_runs_become_placeholders():
    assert normalise("  CA fingerprint SHA256:IqSTTYalA/gc9+EtWuq2OkXI0SXkweVKQuyFE0ugOHQ") == (
        "CA fingerprint SHA256:<fingerprint>"
    )
    assert normalise("│ 3568587548572548990  │ none  │") == normalise(
        "│ 13629138417116937617 │ none │"
    )
    assert normalise("├──────┼───┤") == normalise("├───────┼────┤") == "├─┼─┤"
    assert normalise("x/20261125-222149-kf-linear+fedavg-run14579970323181014888/fused") == (
        "x/<run-folder>/fused"
    )
    assert normalise("sites ran on 2 Ray node(s): 6af05893f508… 3") == (
        "sites ran on 2 Ray node(s): <ray-node>… 3"
    )
    assert normalise("scan-0.png,coat,0.267") == "scan-0.png,coat,<probability>"


def test_shown_lines_are_found_in_order_with_elisions_and_placeholders():
    printed = "warming up\nok\n  site a  node 12345678901  uploaded\nfused: /tmp/x/f\nbye\n"
    assert_shows(printed, "ok\nsite a node 98765432109 uploaded\n...\nbye", [("/tmp/x", "/srv")])
    assert_shows(printed, "fused: /srv/f", [("/tmp/x", "/srv")])
    assert_shows("joining at 127.0.0.1:41234: 2 node(s)", "joining at 127.0.0.1:<port> 2 node(s)")
    assert_shows("fused: o/20261129-101010-a+b-run999/f", "fused: o/20261125-222149-a+b-run12/f")
    with pytest.raises(AssertionError, match="the document shows\nbye\nok"):
        assert_shows(printed, "bye\nok")  # in order
    with pytest.raises(AssertionError):
        assert_shows(printed, "ok\nfused: /tmp/x/f")  # a line between them, not elided
    with pytest.raises(AssertionError):
        assert_shows(printed, "site a node 1 uploaded")  # not an id: a different value
