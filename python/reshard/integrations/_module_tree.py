"""A module tree's registered submodules and parameters, by name and identity, as they were
when taken: a parameter replaced on the module (`m.weight = nn.Parameter(...)`,
`load_state_dict(assign=True)`, re-wrapping) leaves a described storage behind, which forward
no longer reads. `unchanged()` compares identities module by module, with no name strings
built, so it is cheap enough for every transfer."""

from __future__ import annotations

import operator


class ModuleTree:
    def __init__(self, module):
        self.tree = [
            (
                m,
                tuple(m._modules),
                tuple(m._modules.values()),
                tuple(m._parameters),
                tuple(m._parameters.values()),
            )
            for m in module.modules()
        ]

    def unchanged(self) -> bool:
        is_ = operator.is_
        for m, mod_names, mods, param_names, params in self.tree:
            now_mods, now_params = m._modules, m._parameters
            if (
                tuple(now_mods) != mod_names
                or tuple(now_params) != param_names
                or not all(map(is_, now_mods.values(), mods))
                or not all(map(is_, now_params.values(), params))
            ):
                return False
        return True
