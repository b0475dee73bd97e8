import uuid
from typing import Any

from fastapi import APIRouter, HTTPException
from sqlmodel import col, func, select

from app.api.deps import SessionDep
from app.models import Item, ItemCreate, ItemPublic, ItemsPublic, ItemUpdate, Message, User

router = APIRouter(prefix="/items", tags=["items"])


@router.get("/", response_model=ItemsPublic)
async def read_items(session: SessionDep, skip: int = 0, limit: int = 100) -> Any:
    count = (await session.exec(select(func.count()).select_from(Item))).one()
    query = select(Item).order_by(col(Item.created_at).desc()).offset(skip).limit(limit)
    items = (await session.exec(query)).all()
    return ItemsPublic(data=[ItemPublic.model_validate(i) for i in items], count=count)


@router.get("/{id}", response_model=ItemPublic)
async def read_item(session: SessionDep, id: uuid.UUID) -> Any:
    item = await session.get(Item, id)
    if not item:
        raise HTTPException(status_code=404, detail="Item not found")
    return item


@router.post("/", response_model=ItemPublic, status_code=201)
async def create_item(session: SessionDep, item_in: ItemCreate) -> Any:
    if not await session.get(User, item_in.owner_id):
        raise HTTPException(status_code=404, detail="Owner not found")
    item = Item.model_validate(item_in)
    session.add(item)
    await session.commit()
    await session.refresh(item)
    return item


@router.put("/{id}", response_model=ItemPublic)
async def update_item(session: SessionDep, id: uuid.UUID, item_in: ItemUpdate) -> Any:
    item = await session.get(Item, id)
    if not item:
        raise HTTPException(status_code=404, detail="Item not found")
    item.sqlmodel_update(item_in.model_dump(exclude_unset=True))
    session.add(item)
    await session.commit()
    await session.refresh(item)
    return item


@router.delete("/{id}")
async def delete_item(session: SessionDep, id: uuid.UUID) -> Message:
    item = await session.get(Item, id)
    if not item:
        raise HTTPException(status_code=404, detail="Item not found")
    await session.delete(item)
    await session.commit()
    return Message(message="Item deleted successfully")
