"""The ground floor: how a run is parallelized, as data. ``dims.py`` (the degrees), ``schedule.py``
(the schedules and their checks), ``options.py`` (the option enums), ``composition.py`` (what
composes with what) and ``parallel_config.py`` (the one frozen value that holds them all). Nothing
here imports a mechanism; the checks that need the model are ``validation/checks.py``'s."""
