"""``greenswarm report``: one static HTML page from the files sites leave in their run directories.

:mod:`~greenswarm.report.runs` reads each site's ``summary.json``, ``history.jsonl`` and
``rounds.jsonl`` (saying what is missing instead of failing), :mod:`~greenswarm.report.figures` draws
them with matplotlib, and :mod:`~greenswarm.report.page` writes one HTML file with the figures
embedded, so it can be mailed, archived or opened offline.
"""
