"""A plug-in setting that carries the plug-in's own settings (losses, advantage
estimators, data filters).

``SF_TRAINER_LOSS`` names a loss; the loss declares its hyperparameters as a small
pydantic model next to its code (a :class:`PluginSettings`), and they are set under the
plug-in's own name, in the run file or the environment:

    [trainer.loss]                         # or [trainer] loss = "gspo" for the name alone
    name = "gspo"                          # SF_TRAINER_LOSS=gspo
    clip_eps_low = 3e-4                    # SF_TRAINER_LOSS__CLIP_EPS_LOW=3e-4

A :class:`PluginChoice` holds the name and those keys as given; the plug-in's settings
class checks them (:func:`settings_of`): a key the chosen plug-in does not have is a
configuration error naming the keys it has. The trajectory service's data filters take
theirs the same way, one table per listed filter (``sf_trajectory.data_filters``). This
module needs neither torch nor the plug-ins, so the settings class that holds a choice
stays cheap to import.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

NESTED_DELIMITER = "__"
"""Between a plug-in setting's variable and one of its keys: ``SF_TRAINER_LOSS__IS_CAP``."""


class PluginSettings(BaseModel):
    """Base of a plug-in's own settings: every key has a default, an unknown key is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class NoSettings(PluginSettings):
    """The settings of a plug-in that has none."""


Settings = TypeVar("Settings", bound=PluginSettings)


class PluginChoice(BaseModel):
    """Which plug-in (``name``: registered name or ``package.module:attribute``) and the
    keys given for its own settings, unchecked until the plug-in is known."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        # ``loss = "gspo"`` / ``SF_TRAINER_LOSS=gspo``: the name, no keys
        return {"name": value} if isinstance(value, str) else value

    def options(self) -> dict[str, Any]:
        """The keys given for the plug-in's own settings."""
        return dict(self.model_extra or {})

    def __str__(self) -> str:
        return self.name


def settings_of(
    choice: PluginChoice, settings_class: type[Settings], kind: str, variable: str
) -> Settings:
    """``choice``'s keys as the plug-in's settings. A key it does not have, or a value of
    the wrong type, raises ValueError in one line naming the key as a variable
    (``variable`` is the plug-in setting's, e.g. ``SF_TRAINER_LOSS``) and the plug-in's keys."""
    options = choice.options()
    known = list(settings_class.model_fields)
    unknown = [key for key in options if key not in settings_class.model_fields]
    has = f"its keys: {', '.join(known)}" if known else "it has no settings"
    if unknown:
        key = unknown[0]
        raise ValueError(
            f"{kind} {choice.name!r} has no setting {key!r} "
            f"({variable}{NESTED_DELIMITER}{key.upper()}); {has}"
        )
    try:
        return settings_class.model_validate(options)
    except ValidationError as exc:
        problem = exc.errors()[0]
        key = ".".join(str(part) for part in problem["loc"])
        raise ValueError(
            f"{kind} {choice.name!r}: {key} = {options.get(key)!r}: {problem['msg']} "
            f"({variable}{NESTED_DELIMITER}{key.upper()})"
        ) from None
