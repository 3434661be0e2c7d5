"""The edgellm terminal chat (Textual). Entry point: `edgellm.tui.app.run_chat`.

Kept empty of imports so that `import edgellm` never pulls in Textual.
"""
