"""What the serve command and the application share: the API key's environment variable and the default request
timeout."""

API_KEY_ENV = "HYBRIDTRON_API_KEY"
DEFAULT_REQUEST_TIMEOUT_S = 600.0
