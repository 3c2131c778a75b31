"""The Lightning integration: the Trainer and Fabric strategies, and what serves them.

- ``trainer.py``: ``BucketDDP``, the Trainer strategy; ``trainer_launcher.py``, its watched
  launchers; ``trainer_elastic.py``, ``elastic=True`` for the Trainer, and
  ``trainer_loaders.py``, its training loaders' samplers and resume; ``sampler_epoch.py``,
  the first epoch of a resumed fit in its own order;
- ``fabric.py``: ``BucketFabricDDP``, the Fabric strategy; ``fabric_launcher.py``, its
  launchers (and the part both share); ``fabric_cli.py``, ``fabric run`` with our names;
- ``comm_monitor.py``: ``CommMonitor``, the callback;
- ``common.py``: what both strategies share; ``registry.py``: our strategy names registered
  with Lightning as soon as Lightning is imported;
- ``internals.py``: every private Lightning name the others need, and nothing else.

The engine below (``bucketddp.*`` outside this package) imports none of it. Importing this
package imports no Lightning either: ``registry.py``, ``common.py`` and
``sampler_epoch.py`` do not import it; the other modules do.
"""
