"""One router per resource of the admin API; `powerd.api.app.create_app` includes them."""
