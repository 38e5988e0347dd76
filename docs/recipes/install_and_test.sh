pip install -e '.[test,integrations]' && python -m pytest -n 2 -q
