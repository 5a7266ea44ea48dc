"""Run the node agent.

    python -m agents --portal URL --token gpn_... --broker URL --name NAME \\
        --gpus auto|nvml|sim:8xH100-80GB --sandbox docker|kvm|process

Order of start-up: build probe and driver (fail fast on a bad option or a dead
Docker engine), register with the portal (retrying until it answers), adopt
sandboxes left by a previous run, send a first heartbeat so the portal can
stop stale ones, then start the heartbeat and supervisor threads and the
Celery worker on queue ``node.<NAME>`` in this thread. Stopping the agent
leaves sandboxes running: the next start adopts them (docs/reliability.md F-04a).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

from agents.client import PortalClient, PortalError
from agents.probe import make_probe
from agents.protocol import DEFAULT_SANDBOX, NODE_SANDBOXES
from agents.sandbox import SandboxError, make_driver
from agents.worker import END_GATHER_S, RUNNING_HOLD_S, Agent

log = logging.getLogger("agents")


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m agents", description="gpuportal node agent")
    ap.add_argument("--portal", default=env("GPUPORTAL_PORTAL_URL"), help="portal base URL")
    ap.add_argument("--token", default=env("GPUPORTAL_NODE_TOKEN"), help="node token (gpn_...)")
    ap.add_argument("--broker", default=env("CELERY_BROKER_URL"),
                    help="Celery broker URL (wins over CELERY_BROKER_URL in the environment)")
    ap.add_argument("--broker-folder", default=env("GPUPORTAL_BROKER_FOLDER"),
                    help="folder of a filesystem:// broker (the embedded default); must match the portal's")
    ap.add_argument("--name", default=env("GPUPORTAL_NODE_NAME") or os.uname().nodename)
    ap.add_argument("--gpus", default="auto", help="auto | nvml | sim:<N>x<MODEL>-<MEM>GB")
    ap.add_argument("--sandbox", default=DEFAULT_SANDBOX, choices=NODE_SANDBOXES)
    ap.add_argument("--gang-network-driver", choices=["auto", "bridge", "overlay"],
                    default=env("GPUPORTAL_GANG_NETWORK_DRIVER") or "auto",
                    help="docker: the network a multi-node gang's parts share when its project allows "
                         "network (overlay needs the nodes' engines in one swarm; auto: overlay in a swarm, "
                         "else bridge)")
    ap.add_argument("--gang-network-internal", action="store_true",
                    default=env("GPUPORTAL_GANG_NETWORK_INTERNAL", "") in ("1", "true", "yes"),
                    help="docker: a gang's network reaches only its own parts (no egress)")
    ap.add_argument("--gpu-scrub", choices=["on", "off"], default=env("GPUPORTAL_GPU_SCRUB") or "on",
                    help="zero a GPU's memory after each job and before one starts on a GPU not known clean "
                         "(off only where one tenant owns the node)")
    ap.add_argument("--egress-allow", default=env("GPUPORTAL_EGRESS_ALLOW") or "",
                    help="jobs with network: destinations they may reach beyond the public internet (CIDRs or "
                         "host names, comma-separated); the node itself and private ranges are blocked otherwise")
    ap.add_argument("--installation", default=env("GPUPORTAL_INSTALLATION") or "",
                    help="a short name of this portal installation, for hosts whose Docker engine or libvirtd "
                         "serves agents of several installations: sandbox names and adoption go by it and the node")
    ap.add_argument("--state-dir", default=env("GPUPORTAL_AGENT_STATE_DIR") or None,
                    help="the agent's own folder (kvm: per-launch initrd, kernel, console and exit records; "
                         "process: each job's folder and exit code); default /var/lib/gpuportal-agent as root, "
                         "else ~/.local/state/gpuportal-agent")
    ap.add_argument("--volumes-root", default=env("GPUPORTAL_VOLUMES_ROOT") or "",
                    help="the project volumes' tree, at the same path as the portal's VOLUMES_ROOT (a shared "
                         "filesystem on several nodes); jobs naming volumes are refused on a node without it")
    ap.add_argument("--dataset-cache-mb", type=int, default=int(env("GPUPORTAL_DATASET_CACHE_MB") or 51200),
                    help="size limit of this node's dataset cache in <state-dir>/datasets-<name> (docs/storage.md); "
                         "0: no cache, jobs naming datasets are refused here")
    ap.add_argument("--dataset-pin", action="append", metavar="DIGEST",
                    default=[d for d in (env("GPUPORTAL_DATASET_PIN") or "").split(",") if d.strip()],
                    help="a dataset version's digest the cache never evicts (repeat, or comma-separate in "
                         "GPUPORTAL_DATASET_PIN)")
    ap.add_argument("--session-listen", default=env("GPUPORTAL_SESSION_LISTEN") or "",
                    help="HOST:PORT of the session gateway the portal's proxy calls for interactive sessions "
                         "(docs/sessions.md); empty: this node publishes no sessions")
    ap.add_argument("--session-url", default=env("GPUPORTAL_SESSION_URL") or "",
                    help="the gateway's URL as the portal reaches it (default http://HOST:PORT of --session-listen)")
    ap.add_argument("--refused-is-outage", choices=["on", "off"], default=env("GPUPORTAL_REFUSED_IS_OUTAGE") or "on",
                    help="a connection the portal's host refuses (its web processes restarting) renews the lease "
                         "like the portal's outage answer, so jobs run on through a restart of the portal; off "
                         "where a firewall may reject (not drop) this node's packets (docs/reliability.md)")
    ap.add_argument("--slow-is-outage", choices=["on", "off"], default=env("GPUPORTAL_SLOW_IS_OUTAGE") or "on",
                    help="a slow portal (502/503/504 on a direct connection, or a request unanswered while its "
                         "host still accepts connections) renews the lease like its outage answer, so jobs run on "
                         "while the portal is frozen or overloaded; off where this node's path to the portal may "
                         "stay half-open alone (docs/reliability.md)")
    ap.add_argument("--image-cache-gb", type=float, default=env("GPUPORTAL_IMAGE_CACHE_GB") or "0",
                    help="docker: the most GB of job images this node keeps; past it the least recently used "
                         "images it pulled, and no container uses, are removed (0: no limit)")
    ap.add_argument("--running-hold", type=float, default=RUNNING_HOLD_S,
                    help="seconds a launch holds its `running` report: a job ending meanwhile sends both in one request")
    ap.add_argument("--end-gather", type=float, default=END_GATHER_S,
                    help="seconds the supervisor, woken by an exit, waits for others before reporting them together")
    ap.add_argument("--stop-grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--concurrency", type=int, default=4, help="Celery worker threads")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    # argparse checks choices on the command line only, not on defaults from the environment.
    for opt, var in (("gang_network_driver", "GPUPORTAL_GANG_NETWORK_DRIVER"), ("gpu_scrub", "GPUPORTAL_GPU_SCRUB"),
                     ("refused_is_outage", "GPUPORTAL_REFUSED_IS_OUTAGE"),
                     ("slow_is_outage", "GPUPORTAL_SLOW_IS_OUTAGE")):
        choices = next(a.choices for a in ap._actions if a.dest == opt)
        if getattr(args, opt) not in choices:
            ap.error(f"{var}: expected one of {', '.join(choices)}, got {getattr(args, opt)!r}")
    for opt in ("portal", "token", "broker"):
        if not getattr(args, opt):
            ap.error(f"--{opt} is required (or its environment variable)")
    return args


def use_broker(app, url: str, folder: str | None = None) -> None:
    """Point the agent's Celery app at ``url``, the --broker flag's value. Celery reads
    CELERY_BROKER_URL (and CELERY_BROKER_READ_URL / _WRITE_URL) from the environment before its own
    setting, so an environment naming another broker would silently win: the flag wins instead, and the
    environment is made to agree with it."""
    for var in ("CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL"):
        if os.environ.pop(var, None):
            log.warning("%s ignored: the agent uses --broker for reading and writing", var)
    os.environ["CELERY_BROKER_URL"] = url
    app.conf.broker_url = url
    if url.startswith("filesystem://"):
        folder = folder or os.path.join("var", "broker")
        os.makedirs(folder, exist_ok=True)
        app.conf.broker_transport_options = {"data_folder_in": folder, "data_folder_out": folder}


def register_until_answered(agent: Agent, stop: threading.Event) -> None:
    delay = 1.0
    while not stop.is_set():
        try:
            agent.register()
            return
        except PortalError as exc:
            if exc.status in (400, 401, 403, 404):
                raise SystemExit(f"agent: the portal refused registration: {exc}") from None
            log.warning("registration failed (%s); retrying in %.0fs", exc, delay)
        stop.wait(delay)
        delay = min(delay * 2, 30.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The drivers read it from the environment (their default), so every sandbox kind sees the same tree.
    os.environ["GPUPORTAL_VOLUMES_ROOT"] = args.volumes_root
    try:
        probe = make_probe(args.gpus, node_name=args.name)
        # A VM gets its GPUs by PCI address, which only the probe knows.
        extra = {}
        if args.sandbox == "kvm":
            extra = {"pci_bus_ids": {g.index: g.pci_bus_id for g in probe.inventory()},
                     "egress_allow": args.egress_allow, "state_dir": args.state_dir,
                     "installation": args.installation, "supervise": True}
        elif args.sandbox == "process":
            extra = {"state_dir": args.state_dir}
        elif args.sandbox == "docker":
            extra = {"gang_network_driver": args.gang_network_driver,
                     "gang_network_internal": args.gang_network_internal,
                     "simulated_gpus": probe.kind == "sim", "egress_allow": args.egress_allow,
                     "installation": args.installation, "state_dir": args.state_dir, "supervise": True,
                     "image_cache_gb": args.image_cache_gb}
        driver = make_driver(args.sandbox, node=args.name, **extra)
    except (ValueError, SandboxError) as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 2
    client = PortalClient(args.portal, args.token, refused_is_outage=args.refused_is_outage == "on",
                          slow_is_outage=args.slow_is_outage == "on")
    if args.session_listen:
        from agents.sessions import Gateway, SessionDriver

        try:
            gateway = Gateway(listen=args.session_listen, public_url=args.session_url, client=client).start()
        except OSError as exc:
            print(f"agent: --session-listen {args.session_listen}: {exc}", file=sys.stderr)
            return 2
        driver = SessionDriver(driver, gateway)
    datasets = None
    if args.dataset_cache_mb > 0:
        from agents.datasets import DatasetCache
        from agents.sandbox.kvm_domain import driver_dir

        try:  # <state>/datasets-<node>: agents of several nodes on one host never share a cache
            datasets = DatasetCache(str(driver_dir("datasets", args.name, args.state_dir)),
                                    args.dataset_cache_mb * 1024 * 1024, opener=client.open_dataset,
                                    pinned=tuple(d.strip() for d in args.dataset_pin if d.strip()))
        except (OSError, SandboxError) as exc:
            print(f"agent: the dataset cache: {exc}", file=sys.stderr)
            return 2
    agent = Agent(name=args.name, client=client, driver=driver, probe=probe, stop_grace_s=args.stop_grace,
                  scrub_gpus=args.gpu_scrub == "on", datasets=datasets, running_hold_s=args.running_hold,
                  end_gather_s=args.end_gather)

    stop = threading.Event()
    register_until_answered(agent, stop)
    agent.reconcile()
    agent.heartbeat_once()
    threads = [
        threading.Thread(target=agent.run_heartbeats, args=(stop,), name="heartbeat", daemon=True),
        threading.Thread(target=agent.run_supervisor, args=(stop,), name="supervisor", daemon=True),
        # The lease on its own thread: a supervisor pass stuck in a report to a portal that drops
        # our packets (tens of seconds of retries) must not hold the fence up.
        threading.Thread(target=agent.run_lease_checks, args=(stop,), name="lease", daemon=True),
    ]
    for t in threads:
        t.start()

    from celery import signals

    from agents.tasks import app, bind_agent

    bind_agent(agent)
    use_broker(app, args.broker, args.broker_folder)
    queue = f"node.{args.name}"
    log.info("consuming Celery queue %s on %s", queue, args.broker.split("@")[-1])
    asked_to_stop = threading.Event()
    # Celery sends this for SIGINT/SIGTERM/SIGQUIT, never for an "Unrecoverable error" of its own
    # (kombu can die reconnecting after a broker restart): that one must not end the agent.
    signals.worker_shutting_down.connect(lambda **_: asked_to_stop.set(), weak=False)
    try:
        # Threads pool: tasks must run in this process, where the Agent lives.
        # No banner unless debugging: the line above says what it consumes.
        quiet = [] if args.log_level.upper() == "DEBUG" else ["--quiet"]
        app.worker_main([*quiet, "worker", "-Q", queue, "-n", f"agent@{args.name}", "-P", "threads",
                         "-c", str(args.concurrency), "--without-gossip", "--without-mingle",
                         "-l", args.log_level.upper()])
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        agent.join_stops(timeout=args.stop_grace + 5)
        log.info("agent stopped; sandboxes left running for the next start to adopt")
    if asked_to_stop.is_set():
        return 0
    return restart_after_consumer_failure(argv)


def restart_after_consumer_failure(argv) -> int:
    """The Celery consumer ended without being asked to (an "Unrecoverable error"): start the
    agent afresh in this process, which adopts its running sandboxes as any start does. Celery
    cannot be restarted inside one process (its event loop stays closed), hence exec. Called
    with an explicit argv (tests), it returns 1 instead of replacing the caller."""
    if argv is not None:
        return 1
    restarts = int(os.environ.get("GPUPORTAL_AGENT_RESTARTS", "0"))
    delay = min(2 ** restarts, 30)
    log.warning("the Celery consumer stopped by itself; starting the agent again in %d s", delay)
    time.sleep(delay)
    os.environ["GPUPORTAL_AGENT_RESTARTS"] = str(restarts + 1)
    os.execv(sys.executable, [sys.executable, "-m", "agents", *sys.argv[1:]])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
