"""The HTTP routes, one module per group: `completions` (POST /v1/completions), `chat` (POST
/v1/chat/completions), `admin` (models, tokenize, health, metrics, stats, the web page)."""

from hybridkv.server.routes import admin, chat, completions

ROUTERS = (completions.router, chat.router, admin.router)
