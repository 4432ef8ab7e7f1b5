"""The ground floor: how a run is parallelized, as data. ``dims.py`` (the degrees), ``schedule.py``
(the schedules and their checks), ``options.py`` (the option enums), ``sequence.py`` (the sequence split),
``features.py`` (the features a run combines), ``composition.py`` (the pairs refused or exclusive),
``composition_coverage.py`` (the pairs a test compares: generated from the tests' marks),
``composition_markdown.py`` (the table as docs/composition-table.md), ``parallel_config.py`` (the one frozen value
that holds them all) and ``layout.py`` (where each rank sits, and the groups each dimension talks in). Nothing
here imports a mechanism; the checks that need the model are ``validation/checks.py``'s."""
