"""Lightning's ``fabric run`` with bucketddp's strategy names among its choices:
``python -m bucketddp.lightning.fabric_cli run --strategy bucket_ddp ...``.

Lightning's CLI takes the choices of ``--strategy`` from Fabric's registry when it is
imported, and nothing imports bucketddp before that, so ``fabric run --strategy bucket_ddp``
is refused. Lightning reads no entry point for strategies. This module registers our names
first, then runs the command that ``fabric`` runs, with the same arguments. The script it
starts must ``import bucketddp`` before it builds ``Fabric()``, as any script that names
our strategies does. Imports Lightning.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from . import fabric  # noqa: F401  (registers "bucket_ddp" and its twins with Fabric)


def main(argv: list[str] | None = None) -> None:
    """Run Lightning's ``fabric`` command with ``argv`` (the command line if None)."""
    command = next(iter(entry_points(group="console_scripts", name="fabric")))
    command.load()(args=argv, prog_name="python -m bucketddp.lightning.fabric_cli")


if __name__ == "__main__":
    main()
