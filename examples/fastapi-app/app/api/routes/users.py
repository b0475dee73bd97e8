from typing import Any

from fastapi import APIRouter, HTTPException
from sqlmodel import col, func, select

from app.api.deps import SessionDep
from app.models import User, UserCreate, UserPublic, UsersPublic

router = APIRouter(prefix="/users", tags=["users"])


@router.get("/", response_model=UsersPublic)
async def read_users(session: SessionDep, skip: int = 0, limit: int = 100) -> Any:
    count = (await session.exec(select(func.count()).select_from(User))).one()
    users = (
        await session.exec(select(User).order_by(col(User.email)).offset(skip).limit(limit))
    ).all()
    return UsersPublic(data=[UserPublic.model_validate(u) for u in users], count=count)


@router.post("/", response_model=UserPublic, status_code=201)
async def create_user(session: SessionDep, user_in: UserCreate) -> Any:
    if (await session.exec(select(User).where(User.email == user_in.email))).first():
        raise HTTPException(status_code=400, detail="A user with this email already exists")
    user = User.model_validate(user_in)
    session.add(user)
    await session.commit()
    await session.refresh(user)
    return user
