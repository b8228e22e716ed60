"""A deliberately broken polyspec plugin: discovery must report it and carry on."""
