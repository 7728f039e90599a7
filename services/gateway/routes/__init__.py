"""The HTTP API's routes, one APIRouter per API family; app.py's create_app includes them."""
