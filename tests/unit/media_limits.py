# The `limits` fixture: media limits set for one test (omnistage.models.media.configure), defaults restored after.
import pytest

from omnistage.models import media


@pytest.fixture
def limits():
    def set_limits(**kw):
        media.configure(media.MediaLimits(**kw))

    yield set_limits
    media.configure(media.MediaLimits())
