from django.core.management.base import BaseCommand, CommandError

from portal.core.context import Actor
from portal.core.errors import ServiceError

from ...services import node_add


class Command(BaseCommand):
    help = "Register a GPU node (e.g. add_node gpu-01 --gpus 8xH100-80GB) and print its agent token once."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--gpus", default="", help="COUNTxMODEL[-MEMGB], e.g. 8xH100-80GB")
        parser.add_argument("--pool", default="default")
        parser.add_argument("--shared", action="store_true", help="GPUs take fractional jobs")
        parser.add_argument("--cpus", type=int, default=0)
        parser.add_argument("--memory-mb", type=int, default=0)

    def handle(self, *args, name, gpus, pool, shared, cpus, memory_mb, **options):
        try:
            node, secret = node_add(actor=Actor(user=None, label="manage.py"), name=name, gpus=gpus, pool=pool,
                                    shared=shared, cpus=cpus, memory_mb=memory_mb)
        except ServiceError as exc:
            raise CommandError(f"{exc.field or 'node'}: {exc.message}") from None
        self.stderr.write(f"Node {node.name}: {node.gpus.count()} GPUs in pool {node.pool}. Agent token (shown once):")
        self.stdout.write(secret)
