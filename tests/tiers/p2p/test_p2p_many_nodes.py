"""A fleet of 20 ``p2p`` nodes on loopback, default settings, each fetching from every other."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from pathlib import Path

from tests.tiers.p2p.p2p_nodes import SAFETY_S

NODES = 20
CHUNKS = 4
CHUNK_KIB = 16
SCRIPT = Path(__file__).with_name("fleet_node.py")


class FleetNode:
    def __init__(self, index: int, workdir: Path) -> None:
        self.index = index
        self.log_path = workdir / f"node{index}.log"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(SCRIPT), str(index), str(CHUNKS), str(CHUNK_KIB)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=SAFETY_S * 3)
        except queue.Empty:
            line = ""
        if not line:
            raise AssertionError(
                f"node {self.index} said nothing more:\n{self.log_path.read_text()}"
            )
        return line

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text)
        self.process.stdin.flush()

    def finish(self) -> None:
        """Tell the node to report what it served and exit."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()

    def stop(self) -> None:
        self.finish()
        try:
            self.process.wait(SAFETY_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def test_twenty_nodes_each_fetch_everything_from_every_other(tmp_path: Path) -> None:
    nodes = [FleetNode(index, tmp_path) for index in range(NODES)]
    try:
        addresses = [node.next_line().split()[-1] for node in nodes]
        for node in nodes:  # all at once: every node fetches while the others do
            others = [[a, i] for i, a in enumerate(addresses) if i != node.index]
            node.send(json.dumps(others) + "\n")
        reports = [json.loads(node.next_line()) for node in nodes]
        for node in nodes:
            node.finish()
        served = [json.loads(node.next_line())["served"] for node in nodes]
    finally:
        for node in nodes:
            node.stop()
    for report in reports:
        fetched = report["fetched"]
        assert len(fetched) == NODES - 1
        assert all(count == CHUNKS for count in fetched.values()), (
            report,
            (tmp_path / f"node{report['index']}.log").read_text(),
        )
    for node, counters in zip(nodes, served, strict=True):
        assert counters["dropped"] == 0, counters
        assert counters["chunks_served"] >= (NODES - 1) * CHUNKS
        # No budget turned anyone away. (On a loaded machine a handshake may
        # still miss its deadline: the client then tries again.)
        log = node.log_path.read_text()
        assert "displaced by a newer connection" not in log
        assert "authenticated connections are busy" not in log
    # Connections were reused: fewer were opened than requests were answered.
    connects = sum(report["fetcher"]["client_connects"] for report in reports)
    requests = sum(counters["chunks_served"] + counters["queries"] for counters in served)
    assert connects < requests
    assert all(node.process.returncode == 0 for node in nodes)
