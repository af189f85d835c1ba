"""Generation settings (temperature, top-p, top-k, seed, max tokens, presence and frequency penalties);
dismisses with new settings or None."""

from __future__ import annotations

from dataclasses import fields

from textual.containers import Grid, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from kvchat.engine.turn import SamplingParams
from kvchat.tui.text import literal

LABELS = {"temperature": "Temperature (0 = greedy)", "top_p": "Top-p (0, 1]", "top_k": "Top-k (0 = all)",
          "seed": "Seed (blank = random)", "max_tokens": "Max tokens", "presence_penalty": "Presence penalty [-2, 2]",
          "frequency_penalty": "Frequency penalty [-2, 2]"}


def parse_settings(values: dict[str, str]) -> SamplingParams:
    """Build and validate settings from the dialog's text fields.

    Raises:
        ValueError: a field is not a number of the right type or out of range (one line).
    """
    parsed = {}
    for f in fields(SamplingParams):
        text = values[f.name].strip()
        if f.name == "seed" and not text:
            parsed[f.name] = None
            continue
        kind = float if f.type == "float" else int
        try:
            parsed[f.name] = kind(text)
        except ValueError:
            name, wanted = LABELS[f.name].split(" (")[0].lower(), "a number" if kind is float else "an integer"
            raise ValueError(f"{name} must be {wanted}, got {text!r}") from None
    settings = SamplingParams(**parsed)
    settings.validate()
    return settings


class SettingsScreen(ModalScreen[SamplingParams | None]):
    """Enter in any field saves (errors are shown in the dialog), Esc cancels."""

    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, settings: SamplingParams):
        super().__init__(classes="dialog-screen")
        self.settings = settings

    def compose(self):
        with VerticalScroll(classes="dialog", can_focus=False):  # seven fields do not fit a 24-line terminal
            yield Static("Generation settings — Enter saves, Esc cancels", classes="question")
            with Grid(id="settings-grid"):
                for f in fields(SamplingParams):
                    value = getattr(self.settings, f.name)
                    yield Label(LABELS[f.name])
                    yield Input("" if value is None else str(value), id=f.name)
            yield Static("", id="settings-error")

    def on_input_submitted(self) -> None:
        try:
            settings = parse_settings({i.id: i.value for i in self.query(Input)})
        except ValueError as exc:
            self.query_one("#settings-error", Static).update(Content(literal(str(exc))))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)
