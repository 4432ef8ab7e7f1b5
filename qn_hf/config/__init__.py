"""The ground floor: how a run is parallelized, as data. ``dims.py`` (the degrees), ``schedule.py``
(the schedules and their checks), ``options.py`` (the option enums), ``composition.py`` (what
composes with what) ``parallel_config.py`` (the one frozen value that holds them all) and ``layout.py`` (where each
rank sits, and the groups each dimension talks in). Nothing
here imports a mechanism; the checks that need the model are ``validation/checks.py``'s."""
