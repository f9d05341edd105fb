"""A project's own ``conf/`` before feedrate's packaged configs (:mod:`feedrate.project`).

Only where a project is named (``$FEEDRATE_PROJECT``: the ``feedrate`` command's working
directory, inherited by the processes a run starts) and the main config source is feedrate's
packaged ``conf/``: other Hydra apps, and ``python train.py`` in a checkout, are left alone.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ProjectConfig(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from feedrate.project import PROVIDER, is_packaged, project_dir

        project = project_dir()
        main = [e.path for e in search_path.get_path() if e.provider == "main"]
        if project is None or not main or not is_packaged(main[0]):
            return
        conf = project / "conf"
        if any(e.provider == PROVIDER for e in search_path.get_path()) or is_packaged(conf):
            return
        search_path.prepend(PROVIDER, f"file://{conf}")
