"""`python -m services.scheduler --nats URL --port PORT` runs this service alone."""

from services.stack import main_one

main_one("scheduler")
