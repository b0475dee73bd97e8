-- Written for an empty database: `users` is taken in every real one.
CREATE TABLE public.users (id bigint PRIMARY KEY);
