"""Lightning's ``fabric run`` with bucketddp's strategy names among its choices:
``python -m bucketddp.lightning.fabric_cli run --strategy bucket_ddp ...``.

Lightning's CLI takes the choices of ``--strategy`` from Fabric's registry when it is
imported, and Lightning reads no entry point for strategies. An installed bucketddp
registers the names at interpreter start (``bucketddp-strategy-names.pth``), so plain
``fabric run --strategy bucket_ddp`` works; where that hook is switched off
(``BUCKETDDP_NO_STARTUP_HOOK=1``), this module registers our names first, then runs the
command that ``fabric`` runs, with the same arguments. The script it starts must then
``import bucketddp`` before it builds ``Fabric()``. Imports Lightning.
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
