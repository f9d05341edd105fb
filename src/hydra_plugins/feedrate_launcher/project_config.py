"""A project's own ``conf/`` before feedrate's packaged configs (:mod:`feedrate.project`).

Only for a config search path whose main entry is feedrate's packaged ``conf/`` (``feedrate
train``, ``feedrate.compose()`` outside a checkout, the sweep's trial hosts): other Hydra apps
in the same environment are left alone.
"""

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ProjectConfig(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from feedrate.project import PROVIDER, is_packaged

        main = [e.path for e in search_path.get_path() if e.provider == "main"]
        if not main or not is_packaged(main[0]):
            return
        project = Path.cwd() / "conf"
        if any(e.provider == PROVIDER for e in search_path.get_path()) or is_packaged(project):
            return
        search_path.prepend(PROVIDER, f"file://{project}")
