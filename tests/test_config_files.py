"""The shipped YAML configs are found by name (checkout or installed package) or taken as paths."""
import os

import pytest

from sptr.config_files import config_dir, config_path


def test_shipped_configs_by_name_and_paths(tmp_path):
    assert os.path.isfile(os.path.join(config_dir(), "sphereformer_semantickitti.yaml"))
    assert config_path("sphereformer_nuscenes") == config_path("sphereformer_nuscenes.yaml")
    assert config_path("labels/semantickitti").endswith(os.path.join("labels", "semantickitti.yaml"))
    mine = tmp_path / "mine.yaml"
    mine.write_text("num_classes: 3\n")
    assert config_path(str(mine)) == str(mine)
    with pytest.raises(FileNotFoundError, match="sphereformer_semantickitti"):
        config_path("sphereformer_kitti")
