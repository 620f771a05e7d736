"""``engine.ps.reach.describe``: the sentence a worker adds when it loses a server, from every server's
answer just after (None: answered; else the error)."""
from engine.ps.reach import describe

EPS = ["s0:7000", "s1:7000"]


def test_the_path_to_one_server_failed_while_the_others_answer():
    line = describe(EPS, "s1:7000", [None, "UNAVAILABLE: Connection timed out"])
    assert line.startswith("server s1:7000 is unreachable from this host while s0:7000 answers: a network failure "
                           "between this host and it"), line


def test_no_route_from_this_host_blames_its_own_link_not_the_first_server():
    down = "UNAVAILABLE: failed to connect to all addresses; last error: ... error: Network is unreachable"
    line = describe(EPS, "s0:7000", [down, down])
    assert line.startswith("no server answers from this host now, and this host has no route to them"), line
    assert line.endswith("this host's own link or route is down, not server s0:7000 alone"), line


def test_every_server_silent_names_both_causes_and_one_server_only_itself():
    line = describe(EPS, "s0:7000", ["DEADLINE_EXCEEDED: x", "DEADLINE_EXCEEDED: y"])
    assert "this host's own network, or every server's host, failed; not server s0:7000 alone" in line, line
    assert describe(EPS[:1], "s0:7000", ["DEADLINE_EXCEEDED: x"]) == \
        "it does not answer from this host now (s0:7000: DEADLINE_EXCEEDED: x)"


def test_a_server_that_answers_again_was_a_transient_failure_and_long_errors_keep_their_cause():
    assert describe(EPS, "s1:7000", [None, None]) == "server s1:7000 answers again now: the network failure was " \
                                                     "transient"
    long = "UNAVAILABLE: " + "x" * 400 + " error: Connection refused"
    line = describe(EPS, "s0:7000", [long, long])
    assert line.count("Connection refused") == 2 and "x" * 130 not in line, line     # the cause is at the end


def test_no_server_named():
    assert describe(EPS, "", [None, None]) == "every server answers from this host now"
    assert describe(EPS, "", [None, "UNAVAILABLE: z"]) == \
        "from this host now, s1:7000 fail(s) while s0:7000 answer(s) (s1:7000: UNAVAILABLE: z)"
