-- Argo CD health check for inflight.dev/v1alpha1 ModelServer (Lua 5.1, as Argo CD runs it).
-- Install it under `resource.customizations.health.inflight.dev_ModelServer` in argocd-cm.
--   Progressing  the operator has not yet reconciled the current spec (no status, stale
--                status.observedGeneration or a stale condition), or a rollout is under way
--   Degraded     Degraded=True for the current generation (the message says what to change)
--   Healthy      Ready=True for the current generation
local hs = {}

local function find_condition(conditions, condition_type)
  if conditions == nil then
    return nil
  end
  for _, condition in ipairs(conditions) do
    if condition.type == condition_type then
      return condition
    end
  end
  return nil
end

local function describe(condition)
  local text = condition.reason or condition.type
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

local generation = obj.metadata.generation
local status = obj.status
if status == nil or status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the inflight operator to reconcile this ModelServer"
  return hs
end
if generation ~= nil and status.observedGeneration ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the inflight operator to observe generation " .. generation
    .. " (status is for generation " .. status.observedGeneration .. ")"
  return hs
end

local function current(condition)
  if condition == nil then
    return false
  end
  return generation == nil or condition.observedGeneration == nil or condition.observedGeneration == generation
end

local degraded = find_condition(status.conditions, "Degraded")
local ready = find_condition(status.conditions, "Ready")
local progressing = find_condition(status.conditions, "Progressing")

if current(degraded) and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end
if current(ready) and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
hs.status = "Progressing"
if current(progressing) and progressing.status == "True" then
  hs.message = describe(progressing)
elseif current(ready) then
  hs.message = describe(ready)
else
  hs.message = "Waiting for the Ready condition of generation " .. (generation or "?")
end
return hs
