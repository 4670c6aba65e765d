"""Three simulated hosts (network namespaces + veth), one CPU daemon each under
deploy/launch-node.sh, and rolloutd.Coordinator in a fourth namespace (conftest.py). The
scenarios run in the coordinator's namespace (fleet_scenarios.py); the tests check their
reports and what the launchers did. Order matters: they share one fleet."""


def test_weight_session_fans_out_and_rollouts_spread_across_hosts(fleet):
    report = fleet.run_scenario("weights_and_spread")
    assert sorted(report["daemons"]) == sorted(f"{a}/0" for a in fleet.addresses)
    assert report["versions"] == [1, 1, 1]
    assert all(n >= 4 for n in report["spread"].values()), report


def test_every_host_requires_curve(fleet):
    report = fleet.run_scenario("curve_required")
    assert all(a in " ".join(report["daemons"]) for a in fleet.addresses), report
    assert len(report["refused_s"]) == 6 and max(report["refused_s"].values()) < 5, report


def test_killed_daemon_requests_fail_it_restarts_and_rejoins_after_a_push(fleet):
    report = fleet.run_scenario("daemon_lost")
    victim_host = fleet.addresses.index(report["victim"].split("/")[0])
    (d,) = fleet.launchers[victim_host].daemons()
    assert d["restarts"] == 1 and d["state"] == "running", d
    # Noticed fast: the HTTP port refusing connections means the process is gone.
    assert report["detect_s"] < 10, report
    for i, launcher in enumerate(fleet.launchers):
        if i != victim_host:
            assert launcher.daemons()[0]["restarts"] == 0
        assert launcher.proc.poll() is None


def test_requests_of_a_killed_daemon_are_resubmitted_when_asked(fleet):
    report = fleet.run_scenario("resubmit")
    assert report["resubmitted"] >= 1
    assert all(n >= 1 for n in report["retractions"].values())


def test_sigterm_stops_every_host_cleanly(fleet):
    for launcher in fleet.launchers:  # the last victim is back (its launcher restarted it)
        launcher.wait_running(1, timeout=60)
    for launcher in fleet.launchers:
        launcher.proc.send_signal(15)
    for i, launcher in enumerate(fleet.launchers):
        assert launcher.proc.wait(timeout=60) == 0, launcher.read_log()
        stops = [l["exit_code"] for l in launcher.daemon_log_lines(0) if l.get("msg") == "stopped"]
        assert stops and stops[-1] == 0, launcher.daemon_log(0)[-3000:]
