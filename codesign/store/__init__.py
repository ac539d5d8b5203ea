"""The results DB (the only place SQL lives), its schema and migrations, and the CSV exports."""
