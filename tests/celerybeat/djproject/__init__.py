"""A minimal Django project for the django-celery-beat tests: only ``django_celery_beat``
installed, on a database of the test server that each test creates and drops."""
