"""``python -m tests.slurmcluster up|down|status [--run-dir DIR] [--no-capctl]`` (make slurm-up/down).

``up`` starts munge, slurmctld, one slurmd per node (n1..n3) and — unless ``--no-capctl`` — the
simulated GPU nodes, the capctl coordinator, one agent per node and our prolog/epilog; it prints the
environment to use the cluster (``SLURM_CONF``, ``CAPCTL_COORDINATOR``). ``down`` stops everything
started for the run directory. ``status`` lists the recorded processes and the Slurm node states.
"""

from __future__ import annotations

import argparse
import sys

from tests.slurmcluster.cluster import DEFAULT_RUN_DIR, ClusterError, SlurmCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.slurmcluster",
                                     description="Real Slurm test cluster on this host (root).")
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help=f"default {DEFAULT_RUN_DIR}")
    parser.add_argument("--no-capctl", action="store_true", help="Slurm only: no agents, coordinator or hooks")
    parser.add_argument("--accounting", action="store_true", help="also MariaDB + slurmdbd (sacct) and our EpilogSlurmctld")
    args = parser.parse_args(argv)
    cluster = SlurmCluster(run_dir=args.run_dir, capctl=not args.no_capctl, accounting=args.accounting)
    try:
        if args.action == "up":
            cluster.up()
            env = cluster.env()
            print(f"test Slurm cluster up in {cluster.run_dir}: nodes {','.join(cluster.nodes)}")
            print(f"export SLURM_CONF={env['SLURM_CONF']}")
            if cluster.capctl:
                print(f"export CAPCTL_COORDINATOR={env['CAPCTL_COORDINATOR']}")
                print(f"# hook log: {cluster.hook_log}")
            print(f"# logs: {cluster.log_dir}; stop with: make slurm-down")
        elif args.action == "down":
            cluster.down()
            print(f"test Slurm cluster in {cluster.run_dir} stopped")
        else:
            status = cluster.status()
            if not status:
                print(f"no test Slurm cluster recorded in {cluster.run_dir}")
                return 1
            for name, up in sorted(status.items()):
                print(f"{name:16s} {'running' if up else 'stopped'}")
            if status.get("slurmctld"):
                print(cluster.run(["sinfo", "-N", "-o", "%N %T %G"], check=False).stdout, end="")
    except (ClusterError, TimeoutError, RuntimeError) as err:
        print(f"tests.slurmcluster: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
